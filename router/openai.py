"""Typed views of the OpenAI request fields the router reads. Everything else in the body
passes through to the engines untouched."""

from __future__ import annotations

from collections.abc import Iterable
from itertools import chain
from typing import Any

import msgspec

from carryover.router.errors import BadRequest, KvParamsRefused
from carryover.router.fields import refused_field

__all__ = ["BodyLimits", "ChatView", "CompletionView", "parse_body"]

MAX_TOKENS_LIMIT = 10_000_000
MAX_TOKEN_ID = 2**31 - 1  # any vocabulary fits; larger ids are garbage, not a token
_ROLES = frozenset({"system", "developer", "user", "assistant", "tool", "function"})
_decoder = msgspec.json.Decoder()
_CONTAINERS = frozenset({dict, list})  # what a decoded JSON value nests in
#: Template variables the request's own fields set (vLLM refuses ``chat_template`` and
#: ``tokenize`` here too, vllm/renderers/hf.py ``resolve_chat_template_kwargs``).
_RESERVED_TEMPLATE_KWARGS = frozenset(
    {
        "messages",
        "tools",
        "documents",
        "add_generation_prompt",
        "continue_final_message",
        "chat_template",
        "tokenize",
    }
)


class BodyLimits(msgspec.Struct, frozen=True):
    """What one request may hold (the router's settings of the same names)."""

    max_messages: int
    max_tools: int
    max_nesting_depth: int


class StreamOptions(msgspec.Struct, forbid_unknown_fields=False):
    include_usage: bool | None = None


class _Common(msgspec.Struct):
    model: str | None = None
    stream: bool | None = False
    max_tokens: int | None = None
    n: int | None = None
    temperature: float | None = None  # a bool here is a client bug, not 0.0
    return_token_ids: bool | None = None
    conversation_id: str | None = None
    stream_options: StreamOptions | None = None


class ChatView(_Common):
    messages: list[dict[str, Any]] = []
    max_completion_tokens: int | None = None
    chat_template_kwargs: dict[str, Any] | None = None


class CompletionView(_Common):
    prompt: str | list[int] | None = None
    echo: bool | None = None


def _deeper_than(value: object, limit: int) -> bool:
    """Whether JSON ``value`` nests objects and arrays more than ``limit`` deep (the top level
    is depth 1). Level by level, in comprehensions: an 80-message agent body with 20 tools
    (43 KB) takes about 45 µs, what decoding it takes."""
    level: list[Any] = [value]
    for _ in range(limit):
        children: Iterable[Any] = chain.from_iterable(
            [item.values() if type(item) is dict else item for item in level]
        )
        level = [child for child in children if type(child) in _CONTAINERS]
        if not level:
            return False
    return True


def _may_nest_deeper(text: bytes | str, limit: int) -> bool:
    """Whether JSON ``text`` might nest deeper than ``limit``: its count of opening brackets
    bounds its depth, so most bodies need no walk."""
    if isinstance(text, bytes):
        return text.count(b"{") + text.count(b"[") > limit
    return text.count("{") + text.count("[") > limit


def _arguments_deeper_than(arguments: str, limit: int) -> bool:
    if not _may_nest_deeper(arguments, limit):
        return False
    try:
        return _deeper_than(_decoder.decode(arguments), limit)
    except (msgspec.DecodeError, ValueError):
        return False  # not JSON: the renderer reads it as vLLM does
    except RecursionError:
        return True


def _check_arguments_depth(message: dict[str, Any], limit: int) -> None:
    """A tool call's arguments are JSON inside a string, parsed to render: they nest at most
    ``limit`` deep too (vLLM answers deeper ones with a 400; each level costs the renderer
    a frame)."""
    calls = message.get("tool_calls")
    for call in calls if isinstance(calls, list) else ():
        function = call.get("function") if isinstance(call, dict) else None
        arguments = function.get("arguments") if isinstance(function, dict) else None
        if isinstance(arguments, str) and _arguments_deeper_than(arguments, limit):
            raise BadRequest(
                f"tool call arguments nested more than {limit} deep are not accepted",
                param="messages",
            )


def parse_body(
    raw: bytes, *, chat: bool, limits: BodyLimits
) -> tuple[dict[str, Any], ChatView | CompletionView]:
    """Decode and validate a request body; 400 with msgspec's message on anything malformed."""
    try:
        body = _decoder.decode(raw)
    except (msgspec.DecodeError, ValueError) as exc:  # ValueError: invalid UTF-8
        raise BadRequest(f"invalid JSON body: {exc}") from exc
    except RecursionError as exc:
        raise BadRequest(
            f"JSON nested more than {limits.max_nesting_depth} deep is not accepted"
        ) from exc
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    depth = limits.max_nesting_depth
    if _may_nest_deeper(raw, depth) and _deeper_than(body, depth):
        raise BadRequest(f"JSON nested more than {depth} deep is not accepted")
    if "kv_transfer_params" in body:
        raise KvParamsRefused(
            "kv_transfer_params are set by the router; a client may not send them"
        )
    refused = refused_field(body, chat=chat)
    if refused is not None:
        raise BadRequest(f"{refused} is not supported behind a P/D router", param=refused)
    view_type: type[ChatView] | type[CompletionView] = ChatView if chat else CompletionView
    try:
        view = msgspec.convert(body, view_type)
    except msgspec.ValidationError as exc:
        raise BadRequest(str(exc)) from exc
    for name in ("max_tokens", "max_completion_tokens"):
        value = getattr(view, name, None)
        if value is not None and not 1 <= value <= MAX_TOKENS_LIMIT:
            raise BadRequest(f"{name} must be between 1 and {MAX_TOKENS_LIMIT}", param=name)
    if view.n not in (None, 1):
        raise BadRequest("only n=1 is supported", param="n")
    if isinstance(view, ChatView):
        reserved = _RESERVED_TEMPLATE_KWARGS & (view.chat_template_kwargs or {}).keys()
        if reserved:
            raise BadRequest(
                f"chat_template_kwargs may not set {', '.join(sorted(reserved))}: "
                "the request's own fields do",
                param="chat_template_kwargs",
            )
        if not view.messages:
            raise BadRequest("messages must be a non-empty list", param="messages")
        if len(view.messages) > limits.max_messages:
            raise BadRequest(
                f"at most {limits.max_messages} messages are accepted", param="messages"
            )
        tools = body.get("tools")
        if isinstance(tools, list) and len(tools) > limits.max_tools:
            raise BadRequest(f"at most {limits.max_tools} tools are accepted", param="tools")
        for message in view.messages:
            role = message.get("role")
            if not isinstance(role, str) or role not in _ROLES:
                raise BadRequest(f"unknown message role {role!r}", param="messages")
            content = message.get("content")
            if content is not None and not isinstance(content, (str, list)):
                raise BadRequest(
                    "message content must be a string, a list of parts or null", param="messages"
                )
            _check_arguments_depth(message, depth)
    else:
        if view.prompt is None or view.prompt == "" or view.prompt == []:
            raise BadRequest(
                "prompt must be a non-empty string or list of token ids", param="prompt"
            )
        if isinstance(view.prompt, list) and not (
            min(view.prompt) >= 0 and max(view.prompt) <= MAX_TOKEN_ID
        ):
            raise BadRequest(f"token ids must be between 0 and {MAX_TOKEN_ID}", param="prompt")
    return body, view
