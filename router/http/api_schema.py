"""The OpenAPI document the router publishes at ``/openapi.json``.

The generation handlers read the raw body (one decode, OpenAI-shaped errors), so the framework
cannot infer their request schemas; these Structs document what ``carryover.router.openai`` accepts and
the fields it reads. Other fields pass through to the engines, hence open objects.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec

from carryover.router.openai import MAX_TOKEN_ID, MAX_TOKENS_LIMIT, StreamOptions
from carryover.state import MAX_ID_LENGTH

__all__ = ["openapi_document"]

#: printable, no whitespace (``state.keys.validate_identifier`` has the exact rule)
ID_PATTERN = r"^[^\s\x00-\x1f\x7f-\x9f]+$"
ConversationId = Annotated[
    str,
    msgspec.Meta(
        min_length=1,
        max_length=MAX_ID_LENGTH,
        pattern=ID_PATTERN,
        description="Keeps the conversation's KV alive across turns (also as a header).",
    ),
]
MaxTokens = Annotated[int, msgspec.Meta(ge=1, le=MAX_TOKENS_LIMIT)]


class ContentPart(msgspec.Struct, forbid_unknown_fields=False):
    type: str
    text: str | None = None


class ChatMessage(msgspec.Struct, forbid_unknown_fields=False):
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[ContentPart] | None = None


class ChatCompletionRequest(msgspec.Struct, forbid_unknown_fields=False):
    """OpenAI's chat request; ``kv_transfer_params`` is refused (the router sets it)."""

    messages: Annotated[list[ChatMessage], msgspec.Meta(min_length=1)]
    model: str | None = None
    max_tokens: MaxTokens | None = None
    max_completion_tokens: MaxTokens | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    n: Literal[1] | None = None
    temperature: float | None = None
    return_token_ids: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    conversation_id: ConversationId | None = None


class CompletionRequest(msgspec.Struct, forbid_unknown_fields=False):
    """OpenAI's completion request; a prompt of token ids is taken as is."""

    prompt: (
        str
        | Annotated[
            list[Annotated[int, msgspec.Meta(ge=0, le=MAX_TOKEN_ID)]], msgspec.Meta(min_length=1)
        ]
    )
    model: str | None = None
    max_tokens: MaxTokens | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    n: Literal[1] | None = None
    temperature: float | None = None
    return_token_ids: bool | None = None
    conversation_id: ConversationId | None = None


class ErrorDetail(msgspec.Struct):
    message: str
    type: str
    param: str | None
    code: int


class ErrorResponse(msgspec.Struct):
    """OpenAI's error shape, used for every 4xx and 5xx."""

    error: ErrorDetail


class Completion(msgspec.Struct, forbid_unknown_fields=False):
    """A chat or text completion as the engine made it, engine-internal fields removed."""

    id: str
    object: str
    choices: list[dict[str, Any]]


class ModelList(msgspec.Struct, forbid_unknown_fields=False):
    object: Literal["list"]
    data: list[dict[str, Any]]


class Status(msgspec.Struct, forbid_unknown_fields=False):
    status: str


class ConversationEnded(msgspec.Struct, forbid_unknown_fields=False):
    id: str
    deleted: bool  # a record was there
    released: bool  # D was told to free its blocks


_STRUCTS = (
    ChatCompletionRequest,
    CompletionRequest,
    ErrorResponse,
    Completion,
    ModelList,
    Status,
    ConversationEnded,
)


def _ref(name: str) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{name}"}


def _json(name: str) -> dict[str, Any]:
    return {"application/json": {"schema": _ref(name)}}


def _errors(*statuses: int) -> dict[str, Any]:
    return {
        str(s): {"description": "an OpenAI-style error", "content": _json("ErrorResponse")}
        for s in statuses
    }


_CONVERSATION_HEADER = {
    "name": "X-Conversation-ID",
    "in": "header",
    "required": False,
    # Not constrained here: a body ``conversation_id`` wins and the header is then ignored.
    "schema": {"type": "string"},
    "description": (
        "The conversation id when the body has none (X-Session-ID also works); then it must "
        f"be 1 to {MAX_ID_LENGTH} printable characters without whitespace."
    ),
}
_MODEL_QUERY = {
    "name": "model",
    "in": "query",
    "required": False,
    "schema": {"type": "string"},
    "description": "Which model's conversation (needed only when several are served).",
}
_PATH_ID = {
    "name": "conversation_id",
    "in": "path",
    "required": True,
    "schema": {"type": "string", "minLength": 1, "maxLength": MAX_ID_LENGTH, "pattern": ID_PATTERN},
}


def _generation(request: str, summary: str) -> dict[str, Any]:
    return {
        "post": {
            "summary": summary,
            "parameters": [_CONVERSATION_HEADER],
            "requestBody": {"required": True, "content": _json(request)},
            "responses": {
                "200": {
                    "description": "the completion, or a server-sent event stream of chunks",
                    "content": {
                        **_json("Completion"),
                        # OpenAPI 3.1: the schema of one event; each ``data`` is a JSON chunk,
                        # then ``[DONE]`` (an error event before it if D broke off)
                        "text/event-stream": {
                            "schema": {
                                "type": "object",
                                "properties": {"data": {"type": "string"}},
                                "required": ["data"],
                            }
                        },
                    },
                },
                **_errors(400, 401, 404, 413, 422, 502, 503, 504),
            },
        }
    }


def openapi_document() -> dict[str, Any]:
    """OpenAPI 3.1 for every public route."""
    _, components = msgspec.json.schema_components(
        _STRUCTS, ref_template="#/components/schemas/{name}"
    )
    admin: list[dict[str, list[str]]] = [{"admin": []}]
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "carryover",
            "version": "1",
            "description": "An OpenAI-compatible P/D router for vLLM that keeps KV across turns.",
        },
        "paths": {
            "/v1/chat/completions": _generation("ChatCompletionRequest", "Chat completion"),
            "/v1/completions": _generation("CompletionRequest", "Text completion"),
            "/v1/models": {
                "get": {
                    "summary": "Models served by the engines",
                    "responses": {
                        "200": {"description": "models", "content": _json("ModelList")},
                        **_errors(401),
                    },
                }
            },
            "/v1/conversations/{conversation_id}": {
                "delete": {
                    "summary": "End a conversation: drop its record, free D's blocks now",
                    "parameters": [_PATH_ID, _MODEL_QUERY],
                    "responses": {
                        "200": {"description": "ended", "content": _json("ConversationEnded")},
                        **_errors(400, 401, 404, 422, 503),
                    },
                }
            },
            "/admin/conversations/{conversation_id}": {
                "get": {
                    "summary": "A conversation's record, without block ids",
                    "security": admin,
                    "parameters": [
                        _PATH_ID,
                        _MODEL_QUERY,
                        {
                            "name": "tenant",
                            "in": "query",
                            "required": False,
                            "schema": {"type": "string"},
                        },
                    ],
                    "responses": {
                        "200": {
                            "description": "the record summary",
                            "content": {"application/json": {"schema": {"type": "object"}}},
                        },
                        **_errors(400, 401, 404, 422, 503),
                    },
                }
            },
            "/admin/instances/{name}/drain": {
                "post": {
                    "summary": "Take an instance out of rotation (?undo=1 puts it back)",
                    "security": admin,
                    "parameters": [
                        {
                            "name": "name",
                            "in": "path",
                            "required": True,
                            "schema": {"type": "string"},
                        },
                        {
                            "name": "undo",
                            "in": "query",
                            "required": False,
                            "schema": {"type": "string"},
                        },
                    ],
                    "responses": {
                        "200": {
                            "description": "the instance's state",
                            "content": {"application/json": {"schema": {"type": "object"}}},
                        },
                        **_errors(401, 404),
                    },
                }
            },
            "/openapi.json": {
                "get": {
                    "summary": "This document",
                    "responses": {
                        "200": {
                            "description": "OpenAPI 3.1",
                            "content": {"application/json": {"schema": {"type": "object"}}},
                        }
                    },
                }
            },
            "/health": {
                "get": {
                    "summary": "Liveness",
                    "responses": {"200": {"description": "alive", "content": _json("Status")}},
                }
            },
            "/ready": {
                "get": {
                    "summary": "At least one P and one D of a model are healthy",
                    "responses": {
                        "200": {"description": "ready", "content": _json("Status")},
                        **_errors(503),
                    },
                }
            },
            "/metrics": {
                "get": {
                    "summary": "Prometheus metrics",
                    "responses": {
                        "200": {
                            "description": "metrics",
                            "content": {"text/plain": {"schema": {"type": "string"}}},
                        }
                    },
                }
            },
        },
        "components": {
            "schemas": components,
            "securitySchemes": {
                "admin": {"type": "http", "scheme": "bearer"},
                "apiKey": {"type": "http", "scheme": "bearer"},
            },
        },
    }
