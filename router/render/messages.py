"""Chat messages and tools as vLLM hands them to a chat template.

vLLM does not template the client's messages as sent. It rebuilds each one
(``renderers/chat_utils/chat_message.py`` in 0.33.0, ``renderers/chat_utils.py`` in 0.32,
``parse_chat_message_content`` and ``_postprocess_messages``) and dumps the tools through
its pydantic models (``renderers/online_renderer.py``, ``tool.model_dump()``). A template
given the client's own dicts renders another prompt: compact tool-call arguments where vLLM
writes ``json.dumps`` spacing, a ``reasoning_content`` vLLM drops, text part types it reads.
These functions do the same, for templates that take content as a string (vLLM's "string"
content format: text parts joined by newlines). What they cannot reproduce exactly raises
:class:`RenderDeclined` (the engine renders that turn); what vLLM refuses raises
:class:`RenderInputError`. Pure functions: the client's dicts are never changed.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["RenderDeclined", "RenderInputError", "vllm_messages", "vllm_tools"]


class RenderInputError(ValueError):
    """Messages the template cannot render (bad roles, contents, or template errors)."""


class RenderDeclined(Exception):
    """This process cannot render the request exactly as vLLM would: the engine renders it."""


#: Text part types and the key holding their text (vLLM's ``MM_PARSER_MAP``).
_TEXT_PARTS = {
    "text": "text",
    "input_text": "text",
    "output_text": "text",
    "refusal": "refusal",
    "thinking": "thinking",
}
#: A system text starting with this loses its first line (vLLM's
#: ``_strip_claude_code_billing_header``: the line changes on every request).
_BILLING_HEADER = "x-anthropic-billing-header"


def _strip_billing_header(parts: list[Any]) -> list[Any]:
    out: list[Any] = []
    for part in parts:
        if isinstance(part, str):
            text: object = part
        elif isinstance(part, Mapping) and part.get("type") == "text":
            text = part.get("text")
        else:
            text = None
        if not (isinstance(text, str) and text.startswith(_BILLING_HEADER)):
            out.append(part)
            continue
        rest = text.partition("\n")[2]
        if rest:
            out.append(rest if isinstance(part, str) else {**part, "text": rest})
    return out


def _part_text(part: Any) -> str | None:
    """The text one content part contributes (``None``: skipped, as vLLM skips empty ones)."""
    if isinstance(part, str):
        return part or None
    if not isinstance(part, Mapping):
        raise RenderInputError("content parts must be strings or objects")
    kind = part.get("type")
    if part.get("uuid") is not None or kind not in _TEXT_PARTS:
        # Media, tool references, parts without a type: the engine decides.
        raise RenderDeclined(f"content part of type {kind!r}")
    text = part.get(_TEXT_PARTS[kind])
    if text is None or text == "":
        return None
    if not isinstance(text, str):
        raise RenderInputError(f"the {_TEXT_PARTS[kind]!r} of a {kind!r} part must be a string")
    return text


def _content(role: str, content: Any) -> str:
    if content is None:
        parts: list[Any] = []
    elif isinstance(content, str):
        parts = [{"type": "text", "text": content}]
    elif isinstance(content, list):
        parts = content
    else:
        raise RenderInputError("message content must be a string, a list of parts, or null")
    if role == "system":
        parts = _strip_billing_header(parts)
    return "\n".join(t for t in map(_part_text, parts) if t is not None)


def _arguments(function: dict[str, Any]) -> dict[str, Any]:
    """A tool call's arguments as the template gets them: parsed into an object; ``{}`` when
    empty, not JSON, or JSON of another kind (vLLM coerces so a conversation with one bad
    call can go on)."""
    value = function.get("arguments")
    if not value:
        return {}
    if isinstance(value, dict):
        return value
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            return {}
    return value if isinstance(value, dict) else {}


def _tool_calls(calls: list[Any]) -> list[dict[str, Any]]:
    out = []
    for call in calls:
        if not isinstance(call, dict):
            raise RenderInputError("assistant tool_calls entries must be objects")
        function = call.get("function")
        if call.get("type", "function") != "function" or not isinstance(function, dict):
            raise RenderInputError(
                "chat completions only support assistant tool_calls of type 'function'"
            )
        call = copy.deepcopy(call)
        call["function"]["arguments"] = _arguments(function)
        out.append(call)
    return out


def _message(message: Any) -> dict[str, Any]:
    if not isinstance(message, Mapping) or not isinstance(message.get("role"), str):
        raise RenderInputError("each message needs a string 'role'")
    role: str = message["role"]
    result: dict[str, Any] = {"role": role, "content": _content(role, message.get("content"))}
    if role == "assistant":
        calls = message.get("tool_calls")
        if calls is not None:
            if not isinstance(calls, list):
                raise RenderDeclined("tool_calls that are not a list")
            if calls:  # an empty list is dropped: the template takes its plain path
                result["tool_calls"] = _tool_calls(calls)
        reasoning = message.get("reasoning")
        if reasoning is not None:
            if not isinstance(reasoning, str):
                raise RenderDeclined("reasoning that is not a string")
            result["reasoning"] = result["reasoning_content"] = reasoning
    elif role == "tool" and "tool_call_id" in message:
        result["tool_call_id"] = message["tool_call_id"]
    for key in ("name", "task"):
        if isinstance(message.get(key), str):
            result[key] = message[key]
    if role == "developer":
        result["tools"] = message.get("tools")
    return result


def vllm_messages(messages: Any) -> list[dict[str, Any]]:
    """``messages`` as vLLM's chat preprocessing hands them to a string-content template."""
    if not isinstance(messages, Sequence) or isinstance(messages, str | bytes):
        raise RenderInputError("messages must be a list")
    prepared = [_message(m) for m in messages]
    if not prepared:
        raise RenderInputError("messages must not be empty")
    return prepared


def _optional(value: Any, kind: type, what: str) -> Any:
    """``value`` if it is ``None`` or exactly of ``kind`` (pydantic would coerce others)."""
    if value is not None and type(value) is not kind:
        raise RenderDeclined(f"a tool's {what} of another type than vLLM's model")
    return value


def vllm_tools(tools: Any) -> list[dict[str, Any]] | None:
    """``tools`` as vLLM's ``ChatCompletionToolsParam.model_dump()`` gives them to the
    template: its fields in its order, ``description`` and ``parameters`` null when absent,
    ``strict`` and ``defer_loading`` only when set, unknown keys dropped. ``None`` (or an
    empty list, which /tokenize takes as none): no tools."""
    if not tools:
        return None
    if not isinstance(tools, list):
        raise RenderDeclined("tools that are not a list")
    dumped = []
    for tool in tools:
        function = tool.get("function") if isinstance(tool, Mapping) else None
        if (
            not isinstance(function, Mapping)
            or tool.get("type", "function") != "function"
            or not isinstance(function.get("name"), str)
        ):
            raise RenderDeclined("a tool that is not a named function")
        outer_defer = _optional(tool.get("defer_loading"), bool, "defer_loading")
        inner_defer = _optional(function.get("defer_loading"), bool, "defer_loading")
        inner: dict[str, Any] = {
            "name": function["name"],
            "description": _optional(function.get("description"), str, "description"),
            "parameters": _optional(function.get("parameters"), dict, "parameters"),
        }
        strict = _optional(function.get("strict"), bool, "strict")
        if strict is not None:
            inner["strict"] = strict
        # The tool's defer_loading reaches its function when the function has none.
        defer = inner_defer if inner_defer is not None else outer_defer
        if defer is not None:
            inner["defer_loading"] = defer
        entry: dict[str, Any] = {"type": "function", "function": inner}
        if outer_defer is not None:
            entry["defer_loading"] = outer_defer
        dumped.append(entry)
    return dumped
