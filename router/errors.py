"""The router's exceptions, and the one place they become OpenAI-shaped error bodies.

    CarryoverError
    ├── ClientError (4xx)
    │   ├── BadRequest            400
    │   ├── KvParamsRefused       400  client-sent kv_transfer_params would read other users' KV
    │   ├── BadConversationId     400
    │   ├── Unauthorized          401
    │   ├── Forbidden             403
    │   ├── NotFound              404  (ModelNotFound: an unknown model)
    │   ├── BodyTooLarge          413
    │   └── TooManyRequests       429  a tenant over its limit
    └── UpstreamError (5xx)
        ├── EngineUnavailable     503  no healthy instance for a leg
        ├── EngineFailed          502  an instance answered with an error or broke off
        └── EngineTimeout         504

Store failures are not here: ``state.StoreUnavailable`` never reaches a client (the turn is
served cold). httpx errors are mapped in ``carryover.router.engines.upstream`` only.
"""

from __future__ import annotations

import re
from typing import Any

import msgspec

__all__ = [
    "BadConversationId",
    "BadRequest",
    "BodyTooLarge",
    "CarryoverError",
    "ClientError",
    "EngineFailed",
    "EngineTimeout",
    "EngineUnavailable",
    "Forbidden",
    "KvParamsRefused",
    "ModelNotFound",
    "NotFound",
    "TooManyRequests",
    "Unauthorized",
    "UpstreamError",
    "error_body",
    "http_error_type",
    "is_client_fault",
    "sse_error",
]


#: An engine's URL, or a host:port (the default instance name).
_ADDRESS = re.compile(r"\b[a-z][a-z0-9+.-]*://\S+|\[?[\w.:-]+\]?:\d{1,5}\b", re.IGNORECASE)


class CarryoverError(Exception):
    status_code = 500
    error_type = "InternalServerError"
    param: str | None = None

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        if param is not None:
            self.param = param

    @property
    def public_message(self) -> str:
        """The message as a client gets it."""
        return self.message


class ClientError(CarryoverError):
    status_code = 400
    error_type = "BadRequestError"


class BadRequest(ClientError):
    pass


class ClientGone(ClientError):
    """The client disconnected; nothing is sent back (nginx logs this as 499)."""

    status_code = 499
    error_type = "ClientClosedRequest"


class KvParamsRefused(ClientError):
    param = "kv_transfer_params"


class BadConversationId(ClientError):
    param = "conversation_id"


class Unauthorized(ClientError):
    status_code = 401
    error_type = "AuthenticationError"


class Forbidden(ClientError):
    status_code = 403
    error_type = "PermissionDeniedError"


class TooManyRequests(ClientError):
    status_code = 429
    error_type = "RateLimitError"


class NotFound(ClientError):
    status_code = 404
    error_type = "NotFoundError"


class ModelNotFound(NotFound):
    param = "model"


class BodyTooLarge(ClientError):
    status_code = 413
    error_type = "RequestTooLargeError"


class UpstreamError(CarryoverError):
    status_code = 502
    error_type = "BadGatewayError"

    @property
    def public_message(self) -> str:
        """What a client reads: the message without the engines' addresses (logs keep them)."""
        if self.status_code < 500:
            return self.message  # the engine's own words on the client's request
        return _ADDRESS.sub("an engine", self.message)


class EngineUnavailable(UpstreamError):
    status_code = 503
    error_type = "ServiceUnavailableError"


class EngineFailed(UpstreamError):
    """An engine answered with an error status, or broke off. ``status`` is the engine's."""

    def __init__(self, message: str, *, status: int | None = None, body: Any = None) -> None:
        super().__init__(message)
        self.upstream_status = status
        self.upstream_body = body
        # An engine's own 4xx (bad sampling params, context too long) is the client's error.
        if status is not None and 400 <= status < 500:
            self.status_code = status
            self.error_type = "BadRequestError"


def is_client_fault(exc: BaseException) -> bool:
    """An engine's own 4xx: the request is wrong, so no other instance would do better."""
    return (
        isinstance(exc, EngineFailed)
        and exc.upstream_status is not None
        and exc.upstream_status < 500
    )


class EngineTimeout(UpstreamError):
    status_code = 504
    error_type = "GatewayTimeoutError"


_encoder = msgspec.json.Encoder()

_HTTP_ERROR_TYPES = {
    404: "NotFoundError",
    405: "MethodNotAllowedError",
    413: "RequestTooLargeError",
}


def http_error_type(status: int) -> str:
    """The error type of a status the web framework raised (routing, body size)."""
    fallback = "BadRequestError" if status < 500 else "InternalServerError"
    return _HTTP_ERROR_TYPES.get(status, fallback)


def error_body(status: int, message: str, error_type: str, param: str | None = None) -> bytes:
    """OpenAI's error shape (as vLLM sends it)."""
    return _encoder.encode(
        {"error": {"message": message, "type": error_type, "param": param, "code": status}}
    )


def sse_error(exc: UpstreamError) -> bytes:
    """An error as one SSE event: what a client gets when a stream fails mid-way."""
    body = {
        "error": {
            "message": exc.public_message,
            "type": exc.error_type,
            "param": None,
            "code": exc.status_code,
        }
    }
    return b"data: " + _encoder.encode(body) + b"\n\n"
