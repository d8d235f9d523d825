"""The Litestar app: routes, lifespan and error rendering, assembled in ``create_app``."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import importlib
import logging
import random
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Coroutine
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import httpx
import msgspec
from litestar import Litestar, Request, Response, delete, get, post
from litestar.background_tasks import BackgroundTask
from litestar.exceptions import HTTPException
from litestar.response import Stream

from router.api_schema import openapi_document
from router.auth import DEFAULT_TENANT, Authenticator
from router.config import ModelConfig, RouterConfig
from router.errors import (
    BadConversationId,
    CarryoverError,
    ClientGone,
    EngineUnavailable,
    ModelNotFound,
    NotFound,
    error_body,
)
from router.held import report_held_forever
from router.kv.metrics import KvMetrics
from router.kv.service import KvEvents
from router.metrics import RouterMetrics
from router.openai import ChatView, parse_body
from router.pool import InstancePool
from router.render.choose import Renderers
from router.tracing import Tracing
from router.turn import TurnOutcome, TurnRequest, TurnRunner
from router.turn.services import Planner
from router.upstream import Upstream
from state import (
    ConversationKey,
    InvalidIdentifier,
    MemoryStore,
    RedisStore,
    Store,
    StoreUnavailable,
    plan,
)

__all__ = ["Services", "create_app"]

_OPENAPI = msgspec.json.encode(openapi_document())
log = logging.getLogger("carryover.router")

_PATH_HEADER = "X-Carryover-Path"


@dataclass
class Services:
    config: RouterConfig
    store: Store
    upstream: Upstream
    pool: InstancePool
    runner: TurnRunner
    metrics: RouterMetrics
    auth: Authenticator
    model_names: dict[int, str]
    tracing: Tracing
    kv: KvEvents
    clock: Callable[[], float] = time.time
    in_flight: int = 0
    closing: bool = False


def _json(status: int, content: bytes, headers: dict[str, str] | None = None) -> Response[bytes]:
    return Response(content, status_code=status, media_type="application/json", headers=headers)


def _error_response(exc: CarryoverError) -> Response[bytes]:
    return _json(
        exc.status_code, error_body(exc.status_code, exc.message, exc.error_type, exc.param)
    )


def _handle_carryover(_: Request[Any, Any, Any], exc: CarryoverError) -> Response[bytes]:
    return _error_response(exc)


def _handle_http(_: Request[Any, Any, Any], exc: HTTPException) -> Response[bytes]:
    status = exc.status_code
    kinds = {404: "NotFoundError", 405: "MethodNotAllowedError", 413: "RequestTooLargeError"}
    kind = kinds.get(status, "BadRequestError" if status < 500 else "InternalServerError")
    message = exc.detail if status < 500 else "internal error"
    return _json(status, error_body(status, str(message), kind))


def _handle_unexpected(_: Request[Any, Any, Any], exc: Exception) -> Response[bytes]:
    log.exception("unexpected error", exc_info=exc)
    return _json(500, error_body(500, "internal error", "InternalServerError"))


def _services(request: Request[Any, Any, Any]) -> Services:
    services: Services = request.app.state.services
    return services


def _conversation_hash(conversation_id: str) -> str:
    return hashlib.sha256(conversation_id.encode()).hexdigest()[:12]


def _resolve_model(services: Services, name: str | None) -> tuple[ModelConfig, str]:
    models = services.config.models
    for model in models:
        known = services.model_names.get(id(model))
        if known is not None and known == name:
            return model, known
    if len(models) == 1:
        model = models[0]
        known = services.model_names.get(id(model))
        if known is None:
            return model, name or ""
        if name is None:
            return model, known
    raise ModelNotFound(f"The model `{name}` does not exist.")


def _conversation_key(tenant: str, model_name: str, conversation_id: str) -> ConversationKey:
    try:
        # A model whose name is not known yet (discovery pending) still gets one namespace.
        return ConversationKey(tenant, model_name or "default", conversation_id)
    except InvalidIdentifier as exc:
        raise BadConversationId(str(exc)) from exc


def _conversation_id(request: Request[Any, Any, Any], body: dict[str, Any]) -> str | None:
    value: str | None = body.pop("conversation_id", None)
    if value is None:
        for header in _services(request).config.conversation_headers:
            if header.lower() in request.headers:
                value = request.headers[header.lower()]
                break
    return value


async def _generate(request: Request[Any, Any, Any], *, chat: bool) -> Response[bytes] | Stream:
    services = _services(request)
    if services.closing:
        raise EngineUnavailable("the router is shutting down")
    tenant = services.auth.tenant(request.headers.get("authorization"))
    raw = await request.body()
    body, view = parse_body(raw, chat=chat, max_messages=services.config.max_messages)
    conversation_id = _conversation_id(request, body)
    model, model_name = _resolve_model(services, view.model)
    key = None
    if conversation_id is not None:
        key = _conversation_key(tenant, model_name, conversation_id)
    turn = None
    if isinstance(view, ChatView):
        turn = sum(1 for m in view.messages if m.get("role") == "user")
    request_id = request.headers.get("x-request-id") or uuid.uuid4().hex
    if len(request_id) > 128 or not request_id.isprintable():
        request_id = uuid.uuid4().hex
    conversation_hash = _conversation_hash(conversation_id) if conversation_id else None
    trace = services.tracing.turn(
        request.headers,
        request_id=request_id,
        model=model_name,
        tenant=tenant,
        conversation=conversation_hash,
        stream=bool(view.stream),
    )
    turn_request = TurnRequest(
        model=model,
        model_name=model_name,
        key=key,
        body=body,
        chat=chat,
        stream=bool(view.stream),
        client_wants_ids=bool(view.return_token_ids),
        request_id=request_id,
        turn=turn,
        trace=trace,
        started_at=services.clock(),
    )
    services.in_flight += 1
    services.metrics.in_flight.set(services.in_flight)
    started = time.perf_counter()
    outcome = None
    error: str | None = None
    try:
        outcome = await _unless_client_leaves(request, services.runner.run(turn_request))
    except Exception as exc:
        error = type(exc).__name__
        raise
    finally:
        trace.set(path=outcome.path if outcome else "error", turn=turn_request.turn)
        log.info(
            "turn",
            extra={
                "request_id": request_id,
                "conversation": conversation_hash,
                "tenant": tenant,
                "path": outcome.path if outcome else "error",
                "turn": turn_request.turn,
                "stream": turn_request.stream,
                "elapsed_ms": round((time.perf_counter() - started) * 1000, 2),
            },
        )
        if outcome is None or outcome.chunks is None:
            services.in_flight -= 1
            services.metrics.in_flight.set(services.in_flight)
            trace.end(error)
    headers = {_PATH_HEADER: str(outcome.path)} if services.config.expose_path_header else {}
    if outcome.chunks is not None:
        chunks = outcome.chunks
        done = False

        def finish() -> None:
            nonlocal done
            if not done:
                done = True
                services.in_flight -= 1
                services.metrics.in_flight.set(services.in_flight)
                trace.end()

        async def counted() -> AsyncGenerator[bytes, None]:
            try:
                async for chunk in chunks:
                    yield chunk
            finally:
                finish()

        relay = counted()

        async def close_relay() -> None:
            # A stream that never started (the client left before its first byte went out)
            # runs no finally of its own: close it, so the turn's leases and connections go.
            await relay.aclose()
            await chunks.aclose()
            finish()

        return Stream(
            relay,
            media_type="text/event-stream",
            headers={**headers, "Cache-Control": "no-cache"},
            background=BackgroundTask(close_relay),
        )
    assert outcome.body is not None
    return _json(200, outcome.body, headers)


async def _client_left(request: Request[Any, Any, Any]) -> None:
    """Returns when the client disconnects (the body is read: the next message is that)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _unless_client_leaves(
    request: Request[Any, Any, Any], work: Coroutine[Any, Any, TurnOutcome]
) -> TurnOutcome:
    """Run the turn up to its answer (non-streamed) or first chunk (streamed), cancelling its
    engine calls if the client goes away first: nobody would read the result. A streamed
    turn's relay is cancelled by the server itself once the stream has started."""
    turn = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_client_left(request))
    try:
        await asyncio.wait((turn, watcher), return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if not turn.done():
        turn.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await turn
        raise ClientGone("the client disconnected before the answer")
    return turn.result()


@post("/v1/chat/completions", status_code=200)
async def chat_completions(request: Request[Any, Any, Any]) -> Response[bytes] | Stream:
    return await _generate(request, chat=True)


@post("/v1/completions", status_code=200)
async def completions(request: Request[Any, Any, Any]) -> Response[bytes] | Stream:
    return await _generate(request, chat=False)


@get("/v1/models")
async def models(request: Request[Any, Any, Any]) -> Response[bytes]:
    services = _services(request)
    services.auth.tenant(request.headers.get("authorization"))
    data: list[dict[str, Any]] = []
    seen: set[str] = set()
    for model in services.config.models:
        for instance in services.pool.available(model, "decode") + services.pool.available(
            model, "prefill"
        ):
            try:
                answer = await services.upstream.get(
                    f"{instance.url}/v1/models", timeout=services.config.timeouts.health
                )
                entries = answer.json().get("data", [])
            except (CarryoverError, ValueError, AttributeError):
                continue
            for entry in entries:
                if isinstance(entry, dict) and entry.get("id") not in seen:
                    seen.add(str(entry.get("id")))
                    data.append(
                        {
                            k: entry[k]
                            for k in ("id", "object", "created", "owned_by", "max_model_len")
                            if k in entry
                        }
                    )
            break
    return _json(200, msgspec.json.encode({"object": "list", "data": data}))


@get("/openapi.json")
async def openapi() -> Response[bytes]:
    return _json(200, _OPENAPI)


@get("/health")
async def health() -> Response[bytes]:
    return _json(200, b'{"status":"ok"}')


@get("/ready")
async def ready(request: Request[Any, Any, Any]) -> Response[bytes]:
    if _services(request).pool.ready():
        return _json(200, b'{"status":"ready"}')
    return _json(503, error_body(503, "no healthy prefill/decode pair", "ServiceUnavailableError"))


@get("/metrics")
async def metrics(request: Request[Any, Any, Any]) -> Response[bytes]:
    content = _services(request).metrics.render()
    return Response(content, media_type="text/plain; version=0.0.4")


@delete("/v1/conversations/{conversation_id:str}", status_code=200)
async def end_conversation(
    request: Request[Any, Any, Any], conversation_id: str
) -> Response[bytes]:
    """Drop a conversation's record and free its decode blocks now."""
    services = _services(request)
    tenant = services.auth.tenant(request.headers.get("authorization"))
    model, model_name = _resolve_model(services, request.query_params.get("model"))
    key = _conversation_key(tenant, model_name, conversation_id)
    try:
        # Turns still running commit nothing after this (fenced for as long as one can run).
        record = await services.store.delete(
            key, now=services.clock(), fence=services.config.timeouts.request
        )
    except StoreUnavailable as exc:
        raise EngineUnavailable("conversation state is unavailable") from exc
    released = False
    if record is not None:
        released = await services.runner.release(model, model_name, record.handle)
    return _json(
        200,
        msgspec.json.encode(
            {"id": conversation_id, "deleted": record is not None, "released": released}
        ),
    )


@get("/admin/conversations/{conversation_id:str}")
async def inspect_conversation(
    request: Request[Any, Any, Any], conversation_id: str
) -> Response[bytes]:
    """A record's summary (never its handle or block ids)."""
    services = _services(request)
    services.auth.admin(request.headers.get("authorization"))
    tenant = request.query_params.get("tenant") or DEFAULT_TENANT
    _, model_name = _resolve_model(services, request.query_params.get("model"))
    key = _conversation_key(tenant, model_name, conversation_id)
    try:
        record = await services.store.get(key)
    except StoreUnavailable as exc:
        raise EngineUnavailable("conversation state is unavailable") from exc
    if record is None:
        raise NotFound("no record for this conversation")
    now = services.clock()
    summary = {
        "id": conversation_id,
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
    return _json(200, msgspec.json.encode(summary))


@post("/admin/instances/{name:str}/drain", status_code=200)
async def drain_instance(request: Request[Any, Any, Any], name: str) -> Response[bytes]:
    services = _services(request)
    services.auth.admin(request.headers.get("authorization"))
    instance = services.pool.by_name.get(name)
    if instance is None:
        raise NotFound(f"no instance named {name!r}")
    undo = request.query_params.get("undo") in ("1", "true")
    instance.draining = not undo
    return _json(
        200,
        msgspec.json.encode(
            {"instance": name, "draining": instance.draining, "in_flight": instance.in_flight}
        ),
    )


def create_app(
    config: RouterConfig,
    *,
    store: Store | None = None,
    transport: httpx.AsyncBaseTransport | None = None,
    seed: int | None = None,
    clock: Callable[[], float] = time.time,
    planner: Planner | None = None,
) -> Litestar:
    """Build the router. The keyword arguments replace what the config would make: the store
    (embedding, tests), the transport to the engines (in-process fakes), the wall clock
    (records, expiry; tests drive it) and the planner (``state.plan``; the benchmark's
    unchecked arm names its own in ``config.planner``)."""
    chosen_planner = planner or (_import_planner(config.planner) if config.planner else plan)

    @asynccontextmanager
    async def lifespan(app: Litestar) -> AsyncIterator[None]:
        owned_store = store is None
        backend: Store = store or (
            RedisStore.from_url(config.redis, timeout=config.store_timeout)
            if config.redis
            else MemoryStore(clock=clock)
        )
        upstream = Upstream(config.timeouts, transport)
        metrics_ = RouterMetrics()
        pool = InstancePool(config, upstream, backend, metrics_)
        renderers = Renderers(config, upstream, metrics_)
        kv = KvEvents(config, KvMetrics(metrics_.registry))
        runner = TurnRunner(
            config,
            pool,
            backend,
            upstream,
            renderers.by_model,
            metrics_,
            random.Random(seed),
            clock=clock,
            planner=chosen_planner,
            kv=kv,
        )
        services = Services(
            config=config,
            store=backend,
            upstream=upstream,
            pool=pool,
            runner=runner,
            metrics=metrics_,
            auth=Authenticator(config.api_keys, config.admin_key),
            model_names={id(m): m.name for m in config.models if m.name is not None},
            tracing=Tracing.from_environment(),
            clock=clock,
            kv=kv,
        )
        app.state.services = services
        kv.start()
        pool.on_restart.append(lambda instance: kv.instance_restarted(instance.name))
        await pool.start()
        discovery = asyncio.create_task(_discover_names(services))
        renderers.start(pool, lambda model: services.model_names.get(id(model)))
        decode_names = [i.name for i in pool.instances if i.role == "decode"]
        held = asyncio.create_task(
            report_held_forever(backend, decode_names, metrics_, config.held_interval)
        )
        try:
            yield
        finally:
            services.closing = True
            deadline = time.monotonic() + config.shutdown_grace
            while services.in_flight and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            discovery.cancel()
            held.cancel()
            renderers.stop()
            await kv.stop()
            await runner.drain_background()
            await pool.stop()
            await upstream.aclose()
            if owned_store:
                await backend.close()
            await asyncio.to_thread(services.tracing.shutdown)  # flushes the last spans

    return Litestar(
        route_handlers=[
            chat_completions,
            completions,
            models,
            health,
            ready,
            metrics,
            end_conversation,
            inspect_conversation,
            drain_instance,
            openapi,
        ],
        openapi_config=None,  # the published document is router.api_schema's
        lifespan=[lifespan],
        exception_handlers={
            CarryoverError: _handle_carryover,
            HTTPException: _handle_http,
            Exception: _handle_unexpected,
        },
        request_max_body_size=config.max_body_bytes,
        logging_config=None,
    )


def _import_planner(path: str) -> Planner:
    """``module:function``, imported by name (the router never imports the benchmark)."""
    module, _, name = path.partition(":")
    found: Planner = getattr(importlib.import_module(module), name)
    return found


async def _discover_names(services: Services) -> None:
    """Models configured without a name take the first served name their P reports."""
    pending = [m for m in services.config.models if m.name is None]
    while pending:
        for model in list(pending):
            for instance in services.pool.members(model, "prefill") + services.pool.members(
                model, "decode"
            ):
                try:
                    answer = await services.upstream.get(f"{instance.url}/v1/models", timeout=2.0)
                    name = answer.json()["data"][0]["id"]
                except (CarryoverError, ValueError, KeyError, IndexError, TypeError):
                    continue
                services.model_names[id(model)] = str(name)
                pending.remove(model)
                break
        if pending:
            await asyncio.sleep(1.0)
