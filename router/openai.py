"""Typed views of the OpenAI request fields the router reads. Everything else in the body
passes through to the engines untouched."""

from __future__ import annotations

from typing import Any

import msgspec

from carryover.router.errors import BadRequest, KvParamsRefused
from carryover.router.fields import refused_field

__all__ = ["ChatView", "CompletionView", "parse_body"]

MAX_TOKENS_LIMIT = 10_000_000
MAX_TOKEN_ID = 2**31 - 1  # any vocabulary fits; larger ids are garbage, not a token
_ROLES = frozenset({"system", "developer", "user", "assistant", "tool", "function"})
_decoder = msgspec.json.Decoder()
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


def parse_body(
    raw: bytes, *, chat: bool, max_messages: int, max_tools: int
) -> tuple[dict[str, Any], ChatView | CompletionView]:
    """Decode and validate a request body; 400 with msgspec's message on anything malformed."""
    try:
        body = _decoder.decode(raw)
    except (msgspec.DecodeError, ValueError) as exc:  # ValueError: invalid UTF-8
        raise BadRequest(f"invalid JSON body: {exc}") from exc
    except RecursionError as exc:
        raise BadRequest("invalid JSON body: nested too deeply") from exc
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
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
        if len(view.messages) > max_messages:
            raise BadRequest(f"at most {max_messages} messages are accepted", param="messages")
        tools = body.get("tools")
        if isinstance(tools, list) and len(tools) > max_tools:
            raise BadRequest(f"at most {max_tools} tools are accepted", param="tools")
        for message in view.messages:
            role = message.get("role")
            if not isinstance(role, str) or role not in _ROLES:
                raise BadRequest(f"unknown message role {role!r}", param="messages")
            content = message.get("content")
            if content is not None and not isinstance(content, (str, list)):
                raise BadRequest(
                    "message content must be a string, a list of parts or null", param="messages"
                )
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
