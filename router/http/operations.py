"""Health, readiness, metrics, the OpenAPI document, and what operators do to conversations
and instances."""

from __future__ import annotations

from typing import Any

import msgspec
from litestar import Request, Response, delete, get, post
from litestar.params import FromPath

from carryover.router.errors import EngineUnavailable, NotFound, error_body
from carryover.router.fleet.draining import drain
from carryover.router.handles.ledger import Origin
from carryover.router.http.api_schema import openapi_document
from carryover.router.http.auth import DEFAULT_TENANT
from carryover.router.http.readiness import not_ready
from carryover.router.http.services import (
    conversation_key,
    json_response,
    resolve_model,
    services_of,
)
from carryover.router.outcomes import ReleaseCause
from carryover.router.tenants.salt import check_client_salt
from carryover.state import StoreUnavailable

__all__ = [
    "drain_instance",
    "end_conversation",
    "health",
    "inspect_conversation",
    "metrics",
    "openapi",
    "ready",
]

_OPENAPI = msgspec.json.encode(openapi_document())


@get("/openapi.json")
async def openapi() -> Response[bytes]:
    return json_response(200, _OPENAPI)


@get("/health")
async def health() -> Response[bytes]:
    return json_response(200, b'{"status":"ok"}')


@get("/ready")
async def ready(request: Request[Any, Any, Any]) -> Response[bytes]:
    services = services_of(request)
    reason = await not_ready(services)
    if reason is None:
        return json_response(200, b'{"status":"ready"}')
    return json_response(503, error_body(503, reason, "ServiceUnavailableError"))


@get("/metrics")
async def metrics(request: Request[Any, Any, Any]) -> Response[bytes]:
    services = services_of(request)
    services.auth.metrics(request.headers.get("authorization"))
    content = services.metrics.render()
    return Response(content, media_type="text/plain; version=0.0.4")


def _id_of(request: Request[Any, Any, Any], prefix: str) -> str:
    """The conversation id: the rest of the URL path as sent (ids may hold ``/``; the routed
    path parameter is normalized as a file path, which could change an id)."""
    path: str = request.scope["path"]
    return path[len(prefix) :]


def _client_salt(request: Request[Any, Any, Any]) -> str | None:
    """The ``cache_salt`` query parameter: a conversation's turns sent with a salt are
    stored under it, and only the same salt names them."""
    return check_client_salt(request.query_params.get("cache_salt"))


@delete("/v1/conversations/{conversation_id:path}", status_code=200)
async def end_conversation(
    request: Request[Any, Any, Any], conversation_id: FromPath[str]
) -> Response[bytes]:
    """Drop a conversation's record and free its decode blocks now."""
    services = services_of(request)
    tenant = services.auth.tenant(request.headers.get("authorization"))
    resolved = resolve_model(services, request.query_params.get("model"))
    key = conversation_key(
        tenant, resolved, _id_of(request, "/v1/conversations/"), _client_salt(request)
    )
    try:
        # Turns still running commit nothing after this (fenced for as long as one can run).
        record = await services.store.delete(key, fence=services.config.timeouts.request)
    except StoreUnavailable as exc:
        raise EngineUnavailable("conversation state is unavailable") from exc
    released = False
    if record is not None:
        released = await services.runner.give_back(
            resolved.runtime, resolved.name, record.handle, Origin.ENDED, ReleaseCause.DELETED
        )
    return json_response(
        200,
        msgspec.json.encode(
            {"id": key.conversation_id, "deleted": record is not None, "released": released}
        ),
    )


@get("/admin/conversations/{conversation_id:path}")
async def inspect_conversation(
    request: Request[Any, Any, Any], conversation_id: FromPath[str]
) -> Response[bytes]:
    """A record's summary (never its handle or block ids)."""
    services = services_of(request)
    services.auth.admin(request.headers.get("authorization"))
    tenant = request.query_params.get("tenant") or DEFAULT_TENANT
    resolved = resolve_model(services, request.query_params.get("model"))
    key = conversation_key(
        tenant, resolved, _id_of(request, "/admin/conversations/"), _client_salt(request)
    )
    try:
        record = await services.store.get(key)
    except StoreUnavailable as exc:
        raise EngineUnavailable("conversation state is unavailable") from exc
    if record is None:
        raise NotFound("no record for this conversation")
    now = services.clock()
    summary = {
        "id": key.conversation_id,
        "tenant": tenant,
        "turn": record.turn,
        "decode": record.decode,
        "decode_epoch": record.decode_epoch,
        "prefill": record.prefill,
        "tokens": record.prefix.length,
        "output_start": record.prefix.output_start,
        "block_size": record.block_size,
        "age_seconds": round(now - record.created_at, 3),
        "expires_in_seconds": round(record.expires_in(now), 3),
    }
    return json_response(200, msgspec.json.encode(summary))


@post("/admin/instances/{name:str}/drain", status_code=200)
async def drain_instance(request: Request[Any, Any, Any], name: FromPath[str]) -> Response[bytes]:
    services = services_of(request)
    services.auth.admin(request.headers.get("authorization"))
    instance = services.pool.by_name.get(name)
    if instance is None:
        raise NotFound(f"no instance named {name!r}")
    undo = request.query_params.get("undo") in ("1", "true")
    try:
        await drain(services.store, services.pool, instance, not undo)
    except StoreUnavailable as exc:
        raise EngineUnavailable("the fleet's state is unavailable: nothing drained") from exc
    return json_response(
        200,
        msgspec.json.encode(
            {"instance": name, "draining": instance.draining, "in_flight": instance.in_flight}
        ),
    )
