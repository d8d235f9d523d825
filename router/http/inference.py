"""The OpenAI endpoints: a request becomes a turn, its outcome an answer or a stream."""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import random
import time
from collections.abc import Mapping
from typing import Any

import msgspec
from litestar import Request, Response, asgi, get
from litestar.exceptions import HTTPException, MethodNotAllowedException
from litestar.exceptions.http_exceptions import RequestEntityTooLarge
from litestar.types import ASGIApp, Receive, Scope, Send

from carryover.router.errors import (
    CarryoverError,
    ClientGone,
    EngineUnavailable,
    TooManyRequests,
    http_error_type,
)
from carryover.router.http.answers import Answer, DisconnectWatch, EventStream
from carryover.router.http.services import (
    Services,
    conversation_key,
    json_response,
    resolve_model,
    services_of,
)
from carryover.router.openai import ChatView, parse_body
from carryover.router.tenants.salt import check_client_salt
from carryover.router.turn import TurnRequest
from carryover.router.turn.placement import LegChoice

__all__ = ["chat_completions", "completions", "models"]

log = logging.getLogger("carryover.router")

_PATH_HEADER = "X-Carryover-Path"
#: Bodies up to this many bytes are decoded on the event loop (a few hundred microseconds);
#: larger ones in a thread, so that a 10 MB tools list does not hold up every other turn.
_DECODE_INLINE_BYTES = 256 * 1024


_ids = random.Random()  # seeded from the OS; ids need to be unique, not secret
os.register_at_fork(after_in_child=_ids.seed)  # forked workers must not share a sequence


def _new_request_id() -> str:
    return f"{_ids.getrandbits(128):032x}"


def _forwardable(request_id: str) -> bool:
    """A client's ``X-Request-Id`` goes to the engines only as visible ASCII, at most 128
    characters: any other byte can make an engine fail the request (and count against it)."""
    return len(request_id) <= 128 and request_id.isascii() and request_id.isprintable()


def _conversation_id(
    services: Services, headers: Mapping[str, str], body: dict[str, Any]
) -> str | None:
    value: str | None = body.pop("conversation_id", None)
    if value is None:
        for header in services.config.conversation_headers:
            if header.lower() in headers:
                value = headers[header.lower()]
                break
    return value


def _headers(scope: Scope) -> dict[str, str]:
    """The request's headers by lower-case name (ASGI servers lower-case them), the first
    of repeated ones."""
    found: dict[str, str] = {}
    for name, value in scope["headers"]:
        found.setdefault(name.decode("latin-1"), value.decode("latin-1"))
    return found


async def _body(receive: Receive, headers: Mapping[str, str], limit: int) -> bytes:
    """The whole request body, refused past ``limit`` bytes (announced or received) as
    Litestar itself refuses one."""
    announced = headers.get("content-length", "")
    if announced.isdigit() and int(announced) > limit:
        raise RequestEntityTooLarge
    chunks: list[bytes] = []
    received = 0
    while True:
        event = await receive()
        if event["type"] == "http.disconnect":
            raise ClientGone("the client disconnected before its request arrived")
        if event["type"] != "http.request":
            continue
        body = event.get("body", b"")
        if body:
            received += len(body)
            if received > limit:
                raise RequestEntityTooLarge
            chunks.append(body)
        if not event.get("more_body", False):
            return chunks[0] if len(chunks) == 1 else b"".join(chunks)


class _Labels:
    """What a response is counted under (``carryover_responses``), filled in as it is known."""

    __slots__ = ("model",)

    def __init__(self) -> None:
        self.model = ""  # the served model's name, once resolved: never a client's guess


def _placed(placed: Mapping[str, LegChoice]) -> dict[str, Any]:
    """The turn log's fields for where its legs ran: each leg's instance, and for the P
    leg what the KV-event index said it held of the prompt, beside the most any P held."""
    fields: dict[str, Any] = {leg: choice.instance for leg, choice in placed.items()}
    prefill = placed.get("prefill")
    if prefill is not None and prefill.indexed is not None:
        fields["prefill_indexed_tokens"] = prefill.indexed
        fields["prefill_most_indexed_tokens"] = prefill.most_indexed
    return fields


def _status_of(exc: Exception) -> tuple[str, str]:
    if isinstance(exc, CarryoverError):
        return str(exc.status_code), exc.error_type
    if isinstance(exc, HTTPException):
        return str(exc.status_code), http_error_type(exc.status_code)
    return "500", "InternalServerError"


async def _generate(
    scope: Scope, receive: Receive, watch: DisconnectWatch, labels: _Labels, *, chat: bool
) -> ASGIApp:
    if scope.get("method") != "POST":  # a WebSocket scope has none
        raise MethodNotAllowedException(headers={"Allow": "POST"})
    services: Services = scope["litestar_app"].state.services
    if services.closing:
        raise EngineUnavailable("the router is shutting down")
    headers = _headers(scope)
    tenant = services.auth.tenant(headers.get("authorization"))
    raw = await _body(receive, headers, services.config.max_body_bytes)
    if len(raw) < _DECODE_INLINE_BYTES:
        body, view = parse_body(raw, chat=chat, limits=services.limits)
    else:  # a large body is decoded and checked off the loop: the other turns go on
        body, view = await asyncio.to_thread(
            functools.partial(parse_body, raw, chat=chat, limits=services.limits)
        )
    conversation_id = _conversation_id(services, headers, body)
    services.gate.clamp_priority(tenant, body)
    client_salt = check_client_salt(body.get("cache_salt"))
    salt = services.salts.of(tenant, client_salt)
    if salt is None:
        body.pop("cache_salt", None)
    else:
        body["cache_salt"] = salt
    resolved = resolve_model(services, view.model)
    model_name = resolved.name
    labels.model = model_name if resolved.known else ""
    key = None
    if conversation_id is not None:
        key = conversation_key(tenant, resolved, conversation_id, client_salt)
    turn = None
    if isinstance(view, ChatView):
        # The Nth turn follows N - 1 answers: an agent loop's tool results are turns too.
        turn = 1 + sum(1 for m in view.messages if m.get("role") == "assistant")
    request_id = headers.get("x-request-id") or _new_request_id()
    client_request_id = None
    if not _forwardable(request_id):
        # Replaced for the engines; the log keeps the client's, escaped and cut short.
        client_request_id = ascii(request_id[:128])
        request_id = _new_request_id()
    conversation_hash = services.salts.log_id(tenant, conversation_id) if conversation_id else None
    trace = services.tracing.turn(
        headers,
        request_id=request_id,
        model=labels.model,
        tenant=tenant,
        conversation=conversation_hash,
        stream=bool(view.stream),
    )
    turn_request = TurnRequest(
        runtime=resolved.runtime,
        model_name=model_name,
        key=key,
        body=body,
        chat=chat,
        stream=bool(view.stream),
        client_wants_ids=bool(view.return_token_ids),
        request_id=request_id,
        turn=turn,
        tenant=tenant,
        model_name_known=resolved.known,
        body_bytes=len(raw),
        trace=trace,
    )
    try:
        services.gate.enter(tenant)
    except TooManyRequests as exc:
        trace.end(type(exc).__name__)
        raise
    services.in_flight += 1
    started = time.perf_counter()
    outcome = None
    error: str | None = None
    try:
        # The turn runs up to its answer (non-streamed) or first chunk (streamed); a client
        # that goes away first cancels its engine calls: nobody would read the result.
        with watch.guard(raise_gone=True):
            outcome = await services.runner.run(turn_request)
    except Exception as exc:
        error = type(exc).__name__
        raise
    finally:
        trace.set(
            path=outcome.path if outcome else "error",
            turn=turn_request.turn,
            reused_tokens=outcome.reused_tokens if outcome else 0,
        )
        if log.isEnabledFor(logging.INFO):
            log.info(
                "turn",
                extra={
                    "request_id": request_id,
                    "client_request_id": client_request_id,
                    "conversation": conversation_hash,
                    "tenant": tenant,
                    "path": outcome.path if outcome else "error",
                    "turn": turn_request.turn,
                    "prompt_tokens": outcome.prompt_tokens if outcome else None,
                    "reused_tokens": outcome.reused_tokens if outcome else 0,
                    "handle": outcome.handle if outcome else None,
                    **(_placed(outcome.placed) if outcome else {}),
                    "stream": turn_request.stream,
                    "elapsed_ms": round((time.perf_counter() - started) * 1000, 2),
                },
            )
        if outcome is None or outcome.chunks is None:
            services.in_flight -= 1
            services.gate.leave(tenant)
            trace.end(error)
        if len(raw) >= _DECODE_INLINE_BYTES:
            services.large_ended.set()
    assert outcome is not None  # the watch raises ClientGone, it never swallows here
    headers = {_PATH_HEADER: str(outcome.path)} if services.config.expose_path_header else {}
    if outcome.chunks is not None:
        done = False

        def finish() -> None:
            nonlocal done
            if not done:
                done = True
                services.in_flight -= 1
                services.gate.leave(tenant)
                trace.end()

        return EventStream(outcome.chunks, headers, finish, watch)
    assert outcome.body is not None
    return Answer(outcome.body, headers)


# The two hot endpoints are bare ASGI handlers: no Request object, signature model or
# response handling per turn (bench/RESULTS.md, router overhead). Errors still go through
# the app's exception handlers; the OpenAPI document is router.http.api_schema's.
async def _serve(scope: Scope, receive: Receive, send: Send, *, chat: bool) -> None:
    watch = DisconnectWatch(receive)
    labels = _Labels()
    responses = scope["litestar_app"].state.services.metrics.responses
    try:
        try:
            answer = await _generate(scope, receive, watch, labels, chat=chat)
        except Exception as exc:
            responses.labels(labels.model, *_status_of(exc)).inc()
            raise
        # A stream's status is sent now; an error after it is an event in the stream
        # (``carryover_stream_errors``).
        responses.labels(labels.model, "200", "").inc()
        await answer(scope, receive, send)
    finally:
        watch.close()


@asgi("/v1/chat/completions", copy_scope=False)
async def chat_completions(scope: Scope, receive: Receive, send: Send) -> None:
    await _serve(scope, receive, send, chat=True)


@asgi("/v1/completions", copy_scope=False)
async def completions(scope: Scope, receive: Receive, send: Send) -> None:
    await _serve(scope, receive, send, chat=False)


@get("/v1/models")
async def models(request: Request[Any, Any, Any]) -> Response[bytes]:
    services = services_of(request)
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
    return json_response(200, msgspec.json.encode({"object": "list", "data": data}))
