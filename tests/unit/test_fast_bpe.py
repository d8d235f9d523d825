"""The fast span encoder gives the tokenizer's ids, and is refused for tokenizers of another
shape (router/render/fast_bpe.py)."""

from __future__ import annotations

import copy
import json
from functools import cache
from typing import Any

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer

from carryover.router.render.chat_template import ChatTemplate, bundled_qwen3_dir
from carryover.router.render.fast_bpe import FastBpe, fast_bpe_for, refusal
from carryover.router.render.spans import SpanEncoder


@cache
def qwen3() -> tuple[Tokenizer, FastBpe]:
    tokenizer = Tokenizer.from_file(str(bundled_qwen3_dir() / "tokenizer.json"))
    fast = fast_bpe_for(bundled_qwen3_dir(), tokenizer)
    assert fast is not None, "Qwen3's tokenizer has tiktoken's shape"
    return tokenizer, fast


@cache
def qwen3_spec() -> dict[str, Any]:
    spec: dict[str, Any] = json.loads((bundled_qwen3_dir() / "tokenizer.json").read_text())
    return spec


# Any unicode text (no added tokens: those are split off before), and runs of the characters
# the split pattern treats specially.
tricky = st.sampled_from(
    [" ", "  ", "\n", "\r\n", "\t", "'s", "'LL", "123", "\u00a0", "e\u0301", "🙂", "日本", "ﬁ"]
)
texts = st.lists(st.one_of(st.text(max_size=20), tricky), max_size=20).map("".join)


@settings(max_examples=500)
@given(texts)
def test_any_text_encodes_as_the_tokenizer_does(text: str) -> None:
    tokenizer, fast = qwen3()
    # Hypothesis also draws the literals of the code under test ("<think>", ...): an added
    # token is the span encoder's to split off, never this encoder's input.
    added = (token.content for token in tokenizer.get_added_tokens_decoder().values())
    assume(not any(content in text for content in added))
    assert fast.encode(text) == tokenizer.encode(text, add_special_tokens=False).ids


@pytest.mark.parametrize(
    "text",
    ["a" * 20_000, "7" * 20_000, " " * 20_000, "日本語" * 5_000, "ab+/=" * 4_000],
    ids=["letters", "digits", "spaces", "cjk", "base64-like"],
)
def test_long_runs_encode_as_the_tokenizer_does(text: str) -> None:
    # Long single pieces are where a BPE implementation's merge loop shows its worst case.
    tokenizer, fast = qwen3()
    assert fast.encode(text) == tokenizer.encode(text, add_special_tokens=False).ids


def test_every_token_of_the_vocabulary_encodes_to_itself() -> None:
    # A token the fast encoder would split, or merge differently, shows up here first.
    tokenizer, fast = qwen3()
    decoded = {
        token_id: tokenizer.decode([token_id])
        for token_id in range(tokenizer.get_vocab_size(with_added_tokens=False))
    }
    wrong = [
        token_id
        for token_id, text in decoded.items()
        if "\ufffd" not in text
        and fast.encode(text) != tokenizer.encode(text, add_special_tokens=False).ids
    ]
    assert wrong == []


def test_qwen3_has_the_shape() -> None:
    assert refusal(qwen3_spec()) is None


def _changed(path: tuple[Any, ...], value: Any) -> dict[str, Any]:
    spec = copy.deepcopy(qwen3_spec())
    node = spec
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    return spec


@pytest.mark.parametrize(
    ("path", "value", "reason"),
    [
        (("model", "type"), "WordPiece", "not BPE"),
        (("model", "byte_fallback"), True, "byte fallback"),
        (("model", "dropout"), 0.1, "dropout"),
        (("model", "continuing_subword_prefix"), "##", "affixes"),
        (("normalizer",), {"type": "NFKC"}, "normalizer"),
        (("pre_tokenizer", "pretokenizers", 1, "add_prefix_space"), True, "pre-tokenizer"),
        (("pre_tokenizer", "pretokenizers", 0, "behavior"), "Removed", "pre-tokenizer"),
        (("pre_tokenizer",), {"type": "ByteLevel", "add_prefix_space": False}, "pre-tokenizer"),
    ],
)
def test_other_shapes_are_refused(path: tuple[Any, ...], value: Any, reason: str) -> None:
    found = refusal(_changed(path, value))
    assert found is not None and reason in found


def test_merges_out_of_id_order_are_refused() -> None:
    spec = copy.deepcopy(qwen3_spec())
    merges = spec["model"]["merges"]
    merges[10], merges[11] = merges[11], merges[10]
    found = refusal(spec)
    assert found is not None and "merge" in found


def test_ids_below_256_must_be_the_bytes() -> None:
    spec = copy.deepcopy(qwen3_spec())
    vocab = spec["model"]["vocab"]
    first = next(text for text, token_id in vocab.items() if token_id == 0)
    vocab["xy"] = vocab.pop(first)
    found = refusal(spec)
    assert found is not None and "256" in found


def test_an_encoder_that_differs_is_caught_by_the_samples() -> None:
    tokenizer, fast = qwen3()
    assert fast.agrees(tokenizer)
    # Without NFC, "e" + combining acute encodes apart from the tokenizer's "é".
    unnormalized = copy.copy(fast)
    unnormalized._nfc = False
    assert not unnormalized.agrees(tokenizer)


def test_new_spans_go_through_the_fast_encoder() -> None:
    tokenizer, fast = qwen3()
    seen: list[str] = []

    class Recording(FastBpe):
        def __init__(self) -> None:
            pass

        def encode(self, text: str, max_model_len: int | None = None) -> list[int]:
            seen.append(text)
            return fast.encode(text, max_model_len)

    encoder = SpanEncoder(tokenizer, fast=Recording())
    text = "<|im_start|>user\nHello there<|im_end|>\n<|im_start|>assistant\n"
    assert encoder.encode(text) == tokenizer.encode(text, add_special_tokens=False).ids
    assert seen == ["user\nHello there", "\n", "assistant\n"]
    encoder.encode(text)  # all known now
    assert len(seen) == 3


def test_only_the_router_renderer_builds_it() -> None:
    assert ChatTemplate.qwen3().spans._fast is None
    assert ChatTemplate.qwen3(fast_spans=True).spans._fast is qwen3()[1]
