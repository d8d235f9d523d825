"""Chat messages and tools as vLLM hands them to a chat template.

vLLM does not template the client's messages as sent. It rebuilds each one
(``renderers/chat_utils/chat_message.py`` in 0.33.0, ``renderers/chat_utils.py`` in 0.32,
``parse_chat_message_content`` and ``_postprocess_messages``) and dumps the tools through
its pydantic models (``renderers/online_renderer.py``, ``tool.model_dump()``). A template
given the client's own dicts renders another prompt: compact tool-call arguments where vLLM
writes ``json.dumps`` spacing, a deprecated ``reasoning_content`` vLLM renames, keys it drops.
These functions do the same, for templates that take content as a string (vLLM's "string"
content format: text parts joined by newlines). What they cannot reproduce exactly raises
:class:`RenderDeclined` (the engine renders that turn); what vLLM refuses raises
:class:`RenderInputError`. Pure functions: the client's dicts are never changed.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from carryover.router.render.errors import RenderDeclined, RenderInputError

__all__ = [
    "RenderDeclined",
    "RenderInputError",
    "template_names_developer",
    "vllm_messages",
    "vllm_tools",
]


#: Text part types and the key holding their text (vLLM's ``MM_PARSER_MAP``).
_TEXT_PARTS = {
    "text": "text",
    "input_text": "text",
    "output_text": "text",
    "refusal": "refusal",
    "thinking": "thinking",
}
#: The roles of OpenAI's message types. vLLM's request model validates their parts: only
#: these types with a string pass (``input_text``, ``output_text``, bare strings and null
#: texts are refused), and their content may be null only for the assistant. Other roles
#: (vLLM's ``CustomChatCompletionMessageParam``) take every text part type.
_OPENAI_ROLES = frozenset({"system", "user", "assistant", "tool", "developer"})
_OPENAI_ROLE_PARTS = frozenset({"text", "refusal", "thinking"})
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


def _part_text(part: Any, *, openai_role: bool) -> str | None:
    """The text one content part contributes (``None``: skipped, as vLLM skips empty ones)."""
    if isinstance(part, str) and not openai_role:
        return part or None
    if not isinstance(part, Mapping):
        raise RenderDeclined("a content part that is not an object")
    kind = part.get("type")
    allowed = _OPENAI_ROLE_PARTS if openai_role else _TEXT_PARTS.keys()
    if part.get("uuid") is not None or not isinstance(kind, str) or kind not in allowed:
        # Media, tool references, untyped parts, types the request model refuses: the
        # engine decides.
        raise RenderDeclined(f"content part of type {kind!r}")
    key = _TEXT_PARTS[kind]
    text = part.get(key)
    if text is None and not openai_role:
        return None
    if not isinstance(text, str):
        raise RenderDeclined(f"the {key!r} of a {kind!r} part is not a string")
    return text or None


def _raw_parts(role: str, content: Any) -> list[Any]:
    """A message's content as the list of parts vLLM parses (a string is one text part, a
    system message loses its billing header line), whatever format the template takes."""
    if content is None:
        if role in _OPENAI_ROLES and role != "assistant":
            raise RenderDeclined(f"null content of a {role} message")
        parts: list[Any] = []
    elif isinstance(content, str):
        parts = [{"type": "text", "text": content}]
    elif isinstance(content, list):
        parts = content
    else:
        raise RenderDeclined("content that is not a string, a list of parts, or null")
    return _strip_billing_header(parts) if role == "system" else parts


def _content(role: str, content: Any) -> str:
    if isinstance(content, str) and role != "system":
        return content  # one text part: itself (the common case, without building the part)
    openai_role = role in _OPENAI_ROLES
    texts = (_part_text(part, openai_role=openai_role) for part in _raw_parts(role, content))
    return "\n".join(t for t in texts if t is not None)


#: The keys vLLM knows in a content part (``_KNOWN_CONTENT_PART_FIELDS``): any other key
#: reaches an OpenAI-format template with the part, or is dropped by the request model,
#: depending on the role's part model; such a part goes to the engine.
_KNOWN_PART_KEYS = frozenset({"type", "text", "refusal", "thinking"})


def _wrapped_part(part: Any, *, openai_role: bool) -> dict[str, Any] | None:
    """A content part as vLLM hands it to an OpenAI-format template: its text (empty kept)
    as ``{"type": "text", "text": ...}``; ``None``: skipped (a null text or refusal)."""
    if isinstance(part, str) and not openai_role:
        return {"type": "text", "text": part}
    if not isinstance(part, Mapping):
        raise RenderDeclined("a content part that is not an object")
    kind = part.get("type")
    allowed = _OPENAI_ROLE_PARTS if openai_role else _TEXT_PARTS.keys()
    if not isinstance(kind, str) or kind not in allowed or part.keys() - _KNOWN_PART_KEYS:
        raise RenderDeclined(f"content part of type {kind!r} or with keys vLLM passes on")
    text = part.get(_TEXT_PARTS[kind])
    if text is None and kind in ("text", "refusal"):
        return None
    if not isinstance(text, str):
        raise RenderDeclined(f"the text of a {kind!r} part is not a string")
    return {"type": "text", "text": text}


def _parts(role: str, content: Any) -> list[dict[str, Any]] | str:
    """``content`` as vLLM's OpenAI content format hands it to the template: a list of text
    parts; a tool's back to one string (its texts joined by ``\n``, empty ones kept)."""
    openai_role = role in _OPENAI_ROLES
    parts = (_wrapped_part(part, openai_role=openai_role) for part in _raw_parts(role, content))
    wrapped = [part for part in parts if part is not None]
    if role == "tool":
        return "\n".join(part["text"] for part in wrapped)
    return wrapped


def _arguments(function: dict[str, Any]) -> dict[str, Any]:
    """A tool call's arguments as the template gets them: parsed into an object; ``{}`` when
    empty, not JSON, or JSON of another kind (vLLM coerces so a conversation with one bad
    call can go on)."""
    value = function.get("arguments")
    if not value:
        return {}
    try:
        parsed = json.loads(value)
    except json.JSONDecodeError:
        return {}
    except RecursionError as exc:  # vLLM answers such a request with a 400
        raise RenderInputError("tool call arguments are nested too deeply") from exc
    return parsed if isinstance(parsed, dict) else {}


_CALL_KEYS = {"id", "type", "function"}


def _tool_calls(calls: list[Any]) -> list[dict[str, Any]]:
    """Each call as vLLM's request model keeps it: ``id``, ``function`` (``arguments``,
    parsed, then ``name``, then any other keys the client put there), ``type``."""
    out = []
    for call in calls:
        if not isinstance(call, dict):
            raise RenderInputError("assistant tool_calls entries must be objects")
        function = call.get("function")
        if call.get("type", "function") != "function" or not isinstance(function, dict):
            raise RenderInputError(
                "chat completions only support assistant tool_calls of type 'function'"
            )
        fields = (call.get("id"), function.get("name"), function.get("arguments"))
        if not all(isinstance(v, str) for v in fields) or call.keys() != _CALL_KEYS:
            raise RenderDeclined("a tool call of another shape than OpenAI's")
        extra = {k: v for k, v in function.items() if k not in ("arguments", "name")}
        parsed = {"arguments": _arguments(function), "name": function["name"], **extra}
        out.append({"id": call["id"], "function": parsed, "type": "function"})
    return out


def _message(message: Any, *, openai_content: bool) -> dict[str, Any]:
    if not isinstance(message, Mapping) or not isinstance(message.get("role"), str):
        raise RenderInputError("each message needs a string 'role'")
    role: str = message["role"]
    content = message.get("content")
    result: dict[str, Any] = {
        "role": role,
        "content": _parts(role, content) if openai_content else _content(role, content),
    }
    if role == "assistant":
        calls = message.get("tool_calls")
        if calls is not None:
            if not isinstance(calls, list):
                raise RenderDeclined("tool_calls that are not a list")
            if calls:  # an empty list is dropped: the template takes its plain path
                result["tool_calls"] = _tool_calls(calls)
        reasoning = message.get("reasoning")
        if reasoning is None:  # the request model renames the deprecated field
            reasoning = message.get("reasoning_content")
        if reasoning is not None:
            if not isinstance(reasoning, str):
                raise RenderDeclined("reasoning that is not a string")
            result["reasoning"] = result["reasoning_content"] = reasoning
    elif role == "tool" and "tool_call_id" in message:
        result["tool_call_id"] = message["tool_call_id"]
    for key in ("name", "task", "tool_call_id"):
        if message.get(key) is not None and not isinstance(message[key], str):
            raise RenderDeclined(f"a {key} that is not a string")  # the request model's types
    for key in ("name", "task"):
        if isinstance(message.get(key), str):
            result[key] = message[key]
    if role == "developer":
        result["tools"] = message.get("tools")
    return result


def vllm_messages(
    messages: Any, *, developer_role: bool = True, openai_content: bool = False
) -> list[dict[str, Any]]:
    """``messages`` as vLLM's chat preprocessing hands them to a template that takes content
    as a string, or as a list of parts (``openai_content``, ``content_format.py``).
    ``developer_role``: the template names the role; where it does not, vLLM makes developer
    messages system ones and merges every system message into one, first."""
    if not isinstance(messages, Sequence) or isinstance(messages, str | bytes):
        raise RenderInputError("messages must be a list")
    prepared = [_message(m, openai_content=openai_content) for m in messages]
    if not prepared:
        raise RenderInputError("messages must not be empty")
    if not developer_role and any(m["role"] == "developer" for m in prepared):
        return _one_system_message(_developer_as_system(prepared))
    return prepared


def template_names_developer(template: str) -> bool:
    """Whether vLLM leaves developer messages to ``template`` (it looks for the quoted role,
    vllm/renderers/hf.py ``_detect_developer_role_support``)."""
    return '"developer"' in template or "'developer'" in template


def _developer_as_system(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """vLLM 0.32, ``_convert_developer_to_system``: the role renamed, its ``tools`` dropped."""
    converted = []
    for message in messages:
        if message["role"] == "developer":
            message = {k: v for k, v in message.items() if k != "tools"}
            message["role"] = "system"
        converted.append(message)
    return converted


def _one_system_message(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """vLLM 0.32, ``_consolidate_system_messages``: where a system message is not alone and
    first, one system message first, holding the non-empty contents joined by a blank line
    (their other keys dropped), then the rest in order."""
    contents: list[str] = []
    rest: list[dict[str, Any]] = []
    merge = False
    for i, message in enumerate(messages):
        if message["role"] != "system":
            rest.append(message)
            continue
        if i > 0 or contents:
            merge = True
        content = message.get("content", "")
        if isinstance(content, list):
            content = "\n".join(
                part["text"] if isinstance(part, dict) else part
                for part in content
                if (isinstance(part, dict) and "text" in part) or isinstance(part, str)
            )
        if content:
            contents.append(content)
    if not merge:
        return messages
    return [{"role": "system", "content": "\n\n".join(contents)}, *rest]


def _optional(value: Any, kind: type, what: str) -> Any:
    """``value`` if it is ``None`` or exactly of ``kind`` (pydantic would coerce others)."""
    if value is not None and type(value) is not kind:
        raise RenderDeclined(f"a tool's {what} of another type than vLLM's model")
    return value


def vllm_tools(tools: Any) -> list[dict[str, Any]] | None:
    """``tools`` as vLLM's ``ChatCompletionToolsParam.model_dump()`` gives them to the
    template: its fields in its order, ``description`` and ``parameters`` null when absent,
    ``strict`` and ``defer_loading`` only when set, unknown keys dropped. ``None``: no tools
    (an empty list is refused, as vLLM's chat request refuses it)."""
    if tools is None:
        return None
    if tools == []:
        raise RenderInputError("`tools` must not be an empty array")
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
