"""Streamed logprobs resolved in process: tokens and bytes as vLLM's derender gives them, a
character split over several tokens resolved with the ids before it."""

from __future__ import annotations

from carryover.router.render.chat_template import ChatTemplate
from carryover.router.tokens.logprobs import resolve_logprobs


def test_tokens_bytes_and_split_characters() -> None:
    tokenizer = ChatTemplate.qwen3().tokenizer
    ids = list(tokenizer.encode(" plain \U0001d518\U0001d52b text", add_special_tokens=False).ids)
    content = [
        {"token_id": i, "logprob": -0.5, "top_logprobs": [{"token_id": i, "logprob": -0.5}]}
        for i in ids
    ]
    context: list[int] = []
    resolved = resolve_logprobs(content[:2], tokenizer, context)["content"]
    resolved += resolve_logprobs(content[2:], tokenizer, context)["content"]  # a second chunk
    assert resolved[0]["token"] == " plain" and resolved[0]["bytes"] == list(b" plain")
    assert resolved[0]["top_logprobs"] == [
        {"token": " plain", "logprob": -0.5, "bytes": list(b" plain")}
    ]
    # Each of the two letters is three byte tokens: decoded alone they end in U+FFFD; with the ids before
    # them the last carries the character and the others nothing, as in vLLM.
    assert [e["token"] for e in resolved] == [
        " plain",
        "",
        "",
        " \U0001d518",
        "",
        "\U0001d52b",
        " text",
    ]
    assert resolved[3]["bytes"] == list(" \U0001d518".encode())
    assert context == ids[-4:]
