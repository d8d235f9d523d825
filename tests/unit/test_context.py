"""A prompt past the model's context is refused as vLLM refuses it, before its ids are
listed or kept (router/render/context.py)."""

from __future__ import annotations

import random

import pytest
from tokenizers import Tokenizer

from carryover.router.render.chat_template import ChatTemplate, bundled_qwen3_dir
from carryover.router.render.context import PromptTooLong
from carryover.router.render.fast_bpe import fast_bpe_for
from carryover.router.render.spans import SpanEncoder

# Words, digits, non-Latin text and newlines: well past the length counted before listing.
_WORDS = ["ledger", "Garden", " river", "12345", "日本語", "café", "\n", "🙂", "'s"]
_RNG = random.Random(7)
_LONG = " ".join(_RNG.choice(_WORDS) for _ in range(40_000))


def _tokenizer() -> Tokenizer:
    return Tokenizer.from_file(str(bundled_qwen3_dir() / "tokenizer.json"))


def _tokens(text: str) -> int:
    """The reference count: Hugging Face's tokenizer, not the router's encoders."""
    return len(_tokenizer().encode(text, add_special_tokens=False).ids)


def test_the_messages_are_vllms() -> None:
    # vllm/renderers/params.py (0.32), _token_len_check and _text_len_check.
    template = ChatTemplate.qwen3()
    messages = [{"role": "user", "content": _LONG}]
    with pytest.raises(PromptTooLong) as tokens:
        template.render(messages, max_model_len=5000)
    assert tokens.value.param == "input_tokens"
    assert str(tokens.value).startswith(
        "This model's maximum context length is 5000 tokens. However, your prompt contains "
    )
    assert str(tokens.value).endswith(
        " input tokens, which exceeds this limit even without any output tokens. "
        "Please reduce the length of the input prompt."
    )
    with pytest.raises(PromptTooLong) as chars:
        template.render(messages, max_model_len=10)
    text = template.render_text(messages)
    longest = max(len(t) for t in _tokenizer().get_vocab(with_added_tokens=True))
    assert chars.value.param == "input_text"
    assert str(chars.value) == (
        f"This model's maximum context length is 10 tokens. However, your prompt contains "
        f"{len(text)} characters (more than {10 * longest} characters, which is the upper "
        f"bound for 10 input tokens). Please reduce the length of the input prompt."
    )


@pytest.mark.parametrize("fast", [True, False], ids=["fast encoder", "tokenizer"])
def test_a_span_past_the_context_is_refused_and_not_kept(fast: bool) -> None:
    tokenizer = _tokenizer()
    encoder = SpanEncoder(
        tokenizer, fast=fast_bpe_for(bundled_qwen3_dir(), tokenizer) if fast else None
    )
    text = f"<|im_start|>user\n{_LONG}<|im_end|>\n"
    count = _tokens(text)
    with pytest.raises(PromptTooLong, match="input tokens"):
        encoder.encode(text, max_model_len=count // 2)
    assert encoder._chars < len(_LONG), "the refused span was kept"
    # At the context, the ids are the tokenizer's own.
    assert (
        encoder.encode(text, max_model_len=count)
        == tokenizer.encode(text, add_special_tokens=False).ids
    )


def test_the_whole_prompt_counts_not_only_its_spans() -> None:
    template = ChatTemplate.qwen3(fast_spans=True)
    half = _LONG[: len(_LONG) // 2]
    messages = [
        {"role": "user", "content": half},
        {"role": "assistant", "content": "ok"},
        {"role": "user", "content": half + " again"},
    ]
    total = len(template.tokenizer.encode(template.render_text(messages)).ids)
    assert _tokens(half) < total // 2 + 10, "each span alone fits"
    with pytest.raises(PromptTooLong, match=f"contains {total} input tokens"):
        template.render(messages, max_model_len=total - 1)
    assert len(template.render(messages, max_model_len=total)) == total


def test_a_completions_prompt_is_checked_too() -> None:
    template = ChatTemplate.qwen3(fast_spans=True)
    count = len(template.encode_prompt(_LONG))
    with pytest.raises(PromptTooLong):
        template.encode_prompt(_LONG, max_model_len=count - 1)
    assert len(template.encode_prompt(_LONG, max_model_len=count)) == count
