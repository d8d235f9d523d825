"""Detokenizing a stream in process: the text equals the whole answer's, multi-byte characters
split across tokens come out whole, special tokens are skipped as asked."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer

from carryover.router.render.chat_template import ChatTemplate
from carryover.router.tokens.detok import LocalDetokenizer, Vocabulary


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return ChatTemplate.qwen3().tokenizer


def _ids(tokenizer: Tokenizer, text: str) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=False).ids)


async def _stream(detok: LocalDetokenizer, prompt: list[int], output: list[int], step: int):
    state = None
    texts = []
    for start in range(0, len(output), step):
        chunk = {
            "request_id": "generate-tokens-x",
            "choices": [{"index": 0, "token_ids": output[start : start + step]}],
        }
        out, state = await detok.derender_chunk(chunk, state, prompt, {}, chat=True)
        texts.append(out["choices"][0]["delta"]["content"] or "")
        first = out["choices"][0]["delta"]["role"] if start == 0 else None
        if start == 0:
            assert first == "assistant"
    assert state is not None and len(state["ids"]) <= 16  # the window stays small
    return texts


@pytest.mark.parametrize("step", [1, 3])
async def test_streamed_text_adds_up_to_the_whole_answer(tokenizer: Tokenizer, step: int) -> None:
    answer = " Hello — wörld, 日本語も。 🙂 and a  double  space\n" * 6
    prompt = _ids(tokenizer, "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    output = _ids(tokenizer, answer)
    detok = LocalDetokenizer(Vocabulary.of(tokenizer), model="m", skip_special_tokens=True)
    texts = await _stream(detok, prompt, output, step)
    assert "".join(texts) == answer
    assert all("\ufffd" not in t for t in texts)  # no half of an emoji ever goes out


async def test_special_tokens_are_skipped_unless_kept(tokenizer: Tokenizer) -> None:
    end = tokenizer.token_to_id("<|im_end|>")
    output = [*_ids(tokenizer, "done"), end]
    skip = LocalDetokenizer(Vocabulary.of(tokenizer), model="m", skip_special_tokens=True)
    keep = LocalDetokenizer(Vocabulary.of(tokenizer), model="m", skip_special_tokens=False)
    assert "".join(await _stream(skip, [1, 2], output, 1)) == "done"
    assert "".join(await _stream(keep, [1, 2], output, 1)) == "done<|im_end|>"


async def test_completions_chunks_and_usage(tokenizer: Tokenizer) -> None:
    detok = LocalDetokenizer(Vocabulary.of(tokenizer), model="m", skip_special_tokens=True)
    chunk = {"request_id": "r", "choices": [{"index": 0, "token_ids": _ids(tokenizer, "ok")}]}
    out, state = await detok.derender_chunk(chunk, None, [5, 6, 7], {}, chat=False)
    assert out["object"] == "text_completion" and out["choices"][0]["text"] == "ok"
    usage = {"request_id": "r", "choices": [], "usage": {"completion_tokens": 1}}
    out, _ = await detok.derender_chunk(usage, state, [5, 6, 7], {}, chat=False)
    assert out["usage"] == {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}
