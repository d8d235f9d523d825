"""Span-by-span tokenization equals whole-prompt tokenization (router/render/spans.py)."""

from __future__ import annotations

import gc
from functools import cache
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from carryover.router.render.chat_template import ChatTemplate, bundled_qwen3_dir
from carryover.router.render.fast_bpe import fast_bpe_for
from carryover.router.render.spans import SpanEncoder
from tests.support.tokenizers import metaspace_tokenizer

ADDED = ["<|im_start|>", "<|im_end|>", "<think>", "</think>", "<tool_call>", "<|endoftext|>"]


@cache
def qwen3() -> ChatTemplate:
    return ChatTemplate.qwen3()


def whole(text: str) -> list[int]:
    ids: list[int] = qwen3().tokenizer.encode(text, add_special_tokens=False).ids
    return ids


# Text that stresses the boundaries: added tokens glued to words, spaces and newlines around
# them, combining marks and other scripts, partial lookalikes of added tokens.
pieces = st.sampled_from(
    [
        *ADDED,
        " ",
        "  ",
        "\n",
        "\n\n",
        "\t",
        "a",
        "Hello",
        " world",
        "é",
        "e\u0301",
        "日本語",
        "🙂",
        "<|im_",
        "|>",
        "<",
        ">",
        "think",
        "'s",
        "123",
        "3.14",
        "\r\n",
        "\u00a0",
    ]
)
texts = st.lists(st.one_of(pieces, st.text(max_size=12)), max_size=30).map("".join)


@settings(max_examples=300)
@given(texts)
def test_any_text_encodes_as_the_tokenizer_does(text: str) -> None:
    encoder = SpanEncoder(qwen3().tokenizer)
    assert encoder.enabled
    assert encoder.encode(text) == whole(text)
    assert encoder.encode(text) == whole(text)  # again, from the cache


@settings(max_examples=300)
@given(texts)
def test_any_text_encodes_as_the_tokenizer_does_through_the_fast_encoder(text: str) -> None:
    template = qwen3()
    fast = fast_bpe_for(bundled_qwen3_dir(), template.tokenizer)
    assert fast is not None
    encoder = SpanEncoder(template.tokenizer, fast=fast)
    assert encoder.encode(text) == whole(text)


messages = st.lists(
    st.tuples(st.sampled_from(["user", "assistant", "tool"]), texts, st.booleans(), texts),
    min_size=1,
    max_size=8,
)


@settings(max_examples=150)
@given(messages, st.booleans(), st.booleans(), texts)
def test_conversations_encode_the_same_turn_after_turn(
    turns: list[tuple[str, str, bool, str]], thinking: bool, tools: bool, system: str
) -> None:
    template = qwen3()
    encoder = SpanEncoder(template.tokenizer)
    history: list[dict[str, Any]] = [{"role": "system", "content": system}]
    tool_list = (
        [{"type": "function", "function": {"name": "size", "parameters": {"type": "object"}}}]
        if tools
        else None
    )
    for role, content, with_reasoning, reasoning in turns:
        message: dict[str, Any] = {"role": role, "content": content}
        if role == "assistant" and with_reasoning:
            message["reasoning_content"] = reasoning
        history.append(message)
        text = template.render_text(
            history,
            tools=tool_list,
            chat_template_kwargs={"enable_thinking": thinking},
        )
        assert encoder.encode(text) == whole(text)
    # Earlier turns' spans came from the cache.
    assert len(turns) == 1 or encoder.hits > 0


def test_the_cache_is_bounded_in_characters() -> None:
    encoder = SpanEncoder(qwen3().tokenizer, max_chars=100)
    for i in range(50):
        encoder.encode(f"<|im_start|>user\nmessage number {i} with some words<|im_end|>")
    assert encoder._chars <= 100


def test_a_warmed_answer_leaves_the_next_turn_only_its_new_message_to_tokenize() -> None:
    template = ChatTemplate.qwen3()  # its own span cache
    history: list[dict[str, Any]] = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Name a river in Spain, please."},
    ]
    template.encode(template.render_text(history))
    answer = "<think>\nA long one.\n</think>\n\nThe Ebro, which runs into the Mediterranean."
    template.warm(answer)
    history += [
        {"role": "assistant", "content": answer},
        {"role": "user", "content": "And one in Portugal?"},
    ]
    text = template.render_text(history)
    before = template.spans.misses
    assert template.encode(text) == whole(text)
    assert template.spans.misses - before == 1  # the new user message alone


def rendered_warm_text(template: ChatTemplate, answer: str, kwargs: dict[str, Any]) -> str:
    messages = [
        {"role": "user", "content": ""},
        {"role": "assistant", "content": answer},
        {"role": "user", "content": ""},
    ]
    return template.render_text(messages, add_generation_prompt=False, chat_template_kwargs=kwargs)


@settings(max_examples=200, deadline=None)
@given(
    answer=st.text(st.characters(codec="utf-8"), max_size=60)
    | st.sampled_from(["<think>\nhm\n</think>\n\nYes.", "  padded  ", '"quoted" & <b>', ""]),
    thinking=st.sampled_from([None, True, False]),
)
def test_the_warm_up_text_is_what_the_template_renders(answer: str, thinking: bool | None) -> None:
    """The warm-up puts a plain answer into the text found around a marker instead of
    rendering the template; for any answer it must be the text the template renders, or the
    next turn's spans would miss the cache."""
    template = qwen3()
    kwargs = {} if thinking is None else {"enable_thinking": thinking}
    assert template.warm_text(answer, kwargs) == rendered_warm_text(template, answer, kwargs)


def test_a_plain_answer_is_warmed_without_rendering_the_template() -> None:
    template = ChatTemplate.qwen3()  # its own frames
    template.warm("first")  # finds the frame: one render
    renders = 0
    render_text = template.render_text

    def counting(*args: Any, **kwargs: Any) -> str:
        nonlocal renders
        renders += 1
        return render_text(*args, **kwargs)

    template.render_text = counting  # type: ignore[method-assign]
    template.warm("A plain answer.")
    assert renders == 0
    template.warm("<think>\nreasoning\n</think>\n\nAn answer the template parses.")
    assert renders == 1


@cache
def sentencepiece_encoder(scheme: str) -> SpanEncoder:
    return SpanEncoder(metaspace_tokenizer(scheme))


sentencepiece_texts = st.lists(
    st.sampled_from(["<s>", "[INST]", "[/INST]", " ", "\n", "Hello", "world", " fox", "12", "?"]),
    max_size=20,
).map("".join)


@pytest.mark.parametrize("scheme", ["first", "always", "legacy"])
@settings(max_examples=200)
@given(text=sentencepiece_texts)
def test_a_sentencepiece_tokenizer_encodes_as_it_does_whole(scheme: str, text: str) -> None:
    """With ``prepend_scheme`` ``first`` only the text at the very start gets ``▁``, so a span
    after an added token encodes otherwise alone than in place: it is encoded behind one.
    The other schemes encode each span alike wherever it stands. Twice: the second time from
    the span cache."""
    tokenizer = metaspace_tokenizer(scheme)
    encoder = sentencepiece_encoder(scheme)  # one for every text: spans cached across them
    assert encoder.enabled and (encoder._anchor != "") == (scheme == "first")
    want = tokenizer.encode(text, add_special_tokens=False).ids
    assert encoder.encode(text) == want
    assert encoder.encode(text) == want


def test_cached_spans_leave_the_garbage_collector_nothing_to_trace() -> None:
    """The cache holds up to 16M characters of ids; every full collection would walk them."""
    encoder = SpanEncoder(
        qwen3().tokenizer, fast=fast_bpe_for(bundled_qwen3_dir(), qwen3().tokenizer)
    )
    encoder.encode("<|im_start|>warm up<|im_end|>")
    gc.collect()
    before = len(gc.get_objects())
    texts = [f"<|im_start|>tool\nresult {n}: " + "word " * 200 + "<|im_end|>" for n in range(300)]
    for text in texts:
        assert encoder.encode(text) == whole(text)
    gc.collect()
    assert len(gc.get_objects()) - before < 50
    hits = encoder.hits
    assert encoder.encode(texts[0]) == whole(texts[0])  # from the cache, as an array
    assert encoder.hits == hits + 1


def test_the_cache_holds_about_two_bytes_a_character() -> None:
    """A full cache of 16M characters must not hold ~180 MB (a tuple of ints: ~11 bytes a
    character), which a router reaches only after minutes of turns."""
    import random
    import tracemalloc

    encoder = SpanEncoder(
        qwen3().tokenizer, fast=fast_bpe_for(bundled_qwen3_dir(), qwen3().tokenizer)
    )
    rng = random.Random(3)
    words = ["ledger", "garden", "river", "stone", "quartz", "meadow", "lantern", "harbor"]
    texts = [
        f"<|im_start|>user\n{n} " + " ".join(rng.choice(words) for _ in range(80)) + "<|im_end|>"
        for n in range(2_000)
    ]
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for text in texts:
            encoder.encode(text)
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert encoder._chars > 1_000_000
    assert held / encoder._chars < 3.0, f"{held / encoder._chars:.1f} bytes a character"
