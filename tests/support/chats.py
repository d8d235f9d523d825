"""Random chat requests for comparing the router's message preparation with vLLM's: the
shapes agent and chat backends send (tool calls with compact, spaced, empty and broken
arguments, tool results, reasoning fields, every text part type, unicode, stray keys) and
some vLLM refuses. Some are conversations as a chat or agent backend builds them (an
optional system message, then users and assistants in turn, tool results after tool
calls), which templates that insist on that order (Llama 2's, Mistral's) render."""

from __future__ import annotations

import json
import random
from typing import Any

__all__ = ["random_chat"]

_TEXTS = [
    "",
    "Hi",
    "ünïcode 日本語 🙂",
    "  spaced\n\tout  ",
    '{"json": "like"}',
    "<think>x</think>",
]
_PART_TYPES = ["text", "input_text", "output_text", "refusal", "thinking"]


def _text(rng: random.Random) -> str:
    return rng.choice(_TEXTS) + rng.choice(["", " more", "\n"])


def _part(rng: random.Random) -> Any:
    kind = rng.choice([*_PART_TYPES, "plain", "none"])
    if kind == "plain":
        return _text(rng)
    key = {"refusal": "refusal", "thinking": "thinking"}.get(kind, "text")
    if kind == "none":
        return {"type": "text", "text": None}
    return {"type": kind, key: _text(rng)}


def _content(rng: random.Random, *, text_only: bool) -> Any:
    choice = rng.random()
    if choice < 0.4:
        return _text(rng)
    if choice < 0.5:
        return None
    if text_only:
        return [{"type": "text", "text": _text(rng)} for _ in range(rng.randint(0, 3))]
    return [_part(rng) for _ in range(rng.randint(0, 3))]


def _arguments(rng: random.Random) -> Any:
    value = {"id": rng.randint(0, 99), "tag": _text(rng), "deep": {"list": [1, 2.5, None]}}
    return rng.choice(
        [
            json.dumps(value),
            json.dumps(value, separators=(",", ":")),
            json.dumps(value, ensure_ascii=False),
            "",
            "{broken",
            "[1, 2]",
            "null",
        ]
    )


def _call_id(number: int) -> str:
    return f"call{number:05d}"  # nine characters, as Mistral's templates insist


def _tool_call(rng: random.Random, number: int) -> dict[str, Any]:
    call: dict[str, Any] = {
        "id": _call_id(number),
        "type": "function",
        "function": {"name": rng.choice(["lookup", "search"]), "arguments": _arguments(rng)},
    }
    if rng.random() < 0.2:
        call = dict(reversed(list(call.items())))  # the client's own key order
    if rng.random() < 0.1:
        call["function"]["extra"] = "stray"
    return call


def _message(rng: random.Random, number: int) -> dict[str, Any]:
    role = rng.choice(["system", "user", "assistant", "assistant", "tool", "developer"])
    message: dict[str, Any] = {"role": role}
    message["content"] = _content(rng, text_only=role in ("tool", "system", "developer"))
    if role == "assistant":
        if rng.random() < 0.5:
            message["tool_calls"] = [
                _tool_call(rng, number * 10 + i) for i in range(rng.randint(0, 2))
            ]
        if rng.random() < 0.3:
            message["reasoning"] = _text(rng)
        if rng.random() < 0.2:
            message["reasoning_content"] = _text(rng)
    if role == "tool":
        message["tool_call_id"] = _call_id(number)
    if rng.random() < 0.15:
        message["name"] = rng.choice(["ann", "bob", 3])
    if rng.random() < 0.1:
        message["stray"] = {"kept": False}
    if role == "system" and rng.random() < 0.2:
        message["content"] = "x-anthropic-billing-header: cch=1\n" + _text(rng)
    return message


def _tool(rng: random.Random) -> dict[str, Any]:
    function: dict[str, Any] = {"name": rng.choice(["lookup", "search"])}
    if rng.random() < 0.7:
        function["description"] = _text(rng)
    if rng.random() < 0.7:
        function["parameters"] = {"type": "object", "properties": {"id": {"type": "integer"}}}
    if rng.random() < 0.2:
        function["strict"] = rng.choice([True, False])
    if rng.random() < 0.1:
        function["extra"] = 1
    tool: dict[str, Any] = {"type": "function", "function": function}
    if rng.random() < 0.2:
        tool = {"function": function, "type": "function"}
    return tool


def _conversation(rng: random.Random) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = []
    if rng.random() < 0.5:
        messages.append({"role": "system", "content": _text(rng)})
    for turn in range(rng.randint(1, 4)):
        messages.append({"role": "user", "content": _content(rng, text_only=False) or "Hi"})
        if turn and rng.random() < 0.3:
            number = turn * 10
            calls = [_tool_call(rng, number + i) for i in range(rng.randint(1, 2))]
            messages.append({"role": "assistant", "content": None, "tool_calls": calls})
            messages += [
                {"role": "tool", "tool_call_id": call["id"], "content": _text(rng)}
                for call in calls
            ]
        messages.append({"role": "assistant", "content": _text(rng)})
    if rng.random() < 0.7:
        messages.append({"role": "user", "content": _text(rng)})
    return messages


def random_chat(rng: random.Random) -> dict[str, Any]:
    """A chat completions request body (its model is ``m``)."""
    if rng.random() < 0.4:
        messages = _conversation(rng)
    else:
        messages = [_message(rng, n) for n in range(rng.randint(1, 6))]
    body: dict[str, Any] = {"model": "m", "messages": messages}
    if rng.random() < 0.5:
        body["tools"] = [_tool(rng) for _ in range(rng.randint(0, 2))]
    if rng.random() < 0.3:
        body["add_generation_prompt"] = rng.random() < 0.5
    if rng.random() < 0.3:
        body["chat_template_kwargs"] = {"enable_thinking": rng.random() < 0.5}
    return body
