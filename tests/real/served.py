"""What one ``vllm serve`` with the render server's parsers answers, recorded once per run.

The tokens-only pipeline is compared with ``vllm serve`` started with the same parsers
(``test_tokens.py``). ``pd``'s P is such a server (the tiny model, the same engine arguments,
``--reasoning-parser qwen3 --tool-call-parser hermes --enable-auto-tool-choice``; a request
without ``kv_transfer_params`` runs on it as on any server), so its answers are recorded when
``pd`` starts, instead of stopping the tokens-only pair later to start one more engine. The
prompts are fixed and decoding greedy on a seeded model: an answer recorded then is the
answer ``vllm serve`` gives at any time.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import httpx
import msgspec

from carryover.bench.real.launch import SERVED_NAME
from tests.real.helpers import text

__all__ = [
    "CASES",
    "CHAT",
    "PARSERS",
    "SERVER_PARSERS",
    "ServedAnswers",
    "fold_stream",
    "record_served_answers",
    "second_turn",
]

#: The parsers, as the router and the render server are given them.
PARSERS = ["--reasoning-parser", "qwen3", "--tool-call-parser", "hermes"]
SERVER_PARSERS = [*PARSERS, "--enable-auto-tool-choice"]
CHAT = "/v1/chat/completions"
_NONCE = "served-1"  # fixed: the recorded answers hold for every run
_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]
_COMMON = {"model": SERVED_NAME, "temperature": 0, "max_tokens": 24, "ignore_eos": True}
_LOGPROBS = {"logprobs": True, "top_logprobs": 2}
FIRST = [{"role": "user", "content": text(_NONCE, 0, 300)}]

#: (path, body, whether the router gets it as a conversation's first turn)
CASES: list[tuple[str, dict[str, Any], bool]] = [
    (CHAT, {**_COMMON, **_LOGPROBS, "messages": FIRST}, True),
    (CHAT, {**_COMMON, **_LOGPROBS, "messages": FIRST, "tools": _TOOLS}, False),
    (
        CHAT,
        {
            **_COMMON,
            **_LOGPROBS,
            "messages": FIRST,
            "stream": True,
            "stream_options": {"include_usage": True},
        },
        False,
    ),
    ("/v1/completions", {**_COMMON, "prompt": text(_NONCE, 2, 80), "logprobs": 2}, False),
]


def second_turn(first_answer: dict[str, Any]) -> dict[str, Any]:
    """The conversation's second turn after ``first_answer`` (the first case's answer)."""
    reply = first_answer["choices"][0]["message"]
    messages = [
        *FIRST,
        {"role": "assistant", "content": reply["content"] or ""},
        {"role": "user", "content": text(_NONCE, 1, 40)},
    ]
    return {**_COMMON, **_LOGPROBS, "messages": messages}


@dataclass(frozen=True)
class ServedAnswers:
    answers: list[Any]  # one per case of CASES
    second_body: dict[str, Any]
    second_answer: Any


def fold_stream(lines: Iterable[str]) -> dict[str, Any]:
    """A stream folded into one answer: text, reasoning and tool-call arguments joined,
    finish reason, usage and logprobs of choice 0."""
    folded: dict[str, Any] = {"text": "", "reasoning": "", "tools": "", "logprobs": []}
    for line in lines:
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        chunk = msgspec.json.decode(line[6:])
        folded["id"] = chunk["id"]
        folded["usage"] = chunk.get("usage") or folded.get("usage")
        for choice in chunk["choices"]:
            delta = choice.get("delta") or {}
            folded["text"] += delta.get("content") or choice.get("text") or ""
            folded["reasoning"] += delta.get("reasoning") or ""
            for call in delta.get("tool_calls") or ():
                folded["tools"] += (call.get("function") or {}).get("arguments") or ""
            folded["logprobs"] += (choice.get("logprobs") or {}).get("content") or ()
            folded["finish_reason"] = choice.get("finish_reason") or folded.get("finish_reason")
    return folded


def _answer(client: httpx.Client, url: str, path: str, body: dict[str, Any]) -> Any:
    if not body.get("stream"):
        r = client.post(url + path, json=body)
        r.raise_for_status()
        return r.json()
    with client.stream("POST", url + path, json=body) as r:
        r.raise_for_status()
        return fold_stream(r.iter_lines())


def record_served_answers(url: str) -> ServedAnswers:
    """The answers of the server at ``url`` to every case and to the second turn."""
    with httpx.Client(timeout=600) as client:
        answers = [_answer(client, url, path, body) for path, body, _ in CASES]
        second = second_turn(answers[0])
        return ServedAnswers(answers, second, _answer(client, url, CHAT, second))
