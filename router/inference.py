"""The OpenAI endpoints: a request becomes a turn, its outcome an answer or a stream."""

from __future__ import annotations

import hashlib
import logging
import os
import random
import time
from typing import Any

import msgspec
from litestar import Request, Response, get, post
from litestar.types import ASGIApp

from router.answers import Answer, CancelOnDisconnect, EventStream
from router.errors import CarryoverError, EngineUnavailable
from router.openai import ChatView, parse_body
from router.services import conversation_key, json_response, resolve_model, services_of
from router.turn import TurnRequest

__all__ = ["chat_completions", "completions", "models"]

log = logging.getLogger("carryover.router")

_PATH_HEADER = "X-Carryover-Path"


_ids = random.Random()  # seeded from the OS; ids need to be unique, not secret
os.register_at_fork(after_in_child=_ids.seed)  # forked workers must not share a sequence


def _new_request_id() -> str:
    return f"{_ids.getrandbits(128):032x}"


def _conversation_hash(conversation_id: str) -> str:
    return hashlib.sha256(conversation_id.encode()).hexdigest()[:12]


def _conversation_id(request: Request[Any, Any, Any], body: dict[str, Any]) -> str | None:
    value: str | None = body.pop("conversation_id", None)
    if value is None:
        for header in services_of(request).config.conversation_headers:
            if header.lower() in request.headers:
                value = request.headers[header.lower()]
                break
    return value


async def _generate(request: Request[Any, Any, Any], *, chat: bool) -> ASGIApp:
    services = services_of(request)
    if services.closing:
        raise EngineUnavailable("the router is shutting down")
    tenant = services.auth.tenant(request.headers.get("authorization"))
    raw = await request.body()
    body, view = parse_body(raw, chat=chat, max_messages=services.config.max_messages)
    conversation_id = _conversation_id(request, body)
    model, model_name = resolve_model(services, view.model)
    key = None
    if conversation_id is not None:
        key = conversation_key(tenant, model_name, conversation_id)
    turn = None
    if isinstance(view, ChatView):
        turn = sum(1 for m in view.messages if m.get("role") == "user")
    request_id = request.headers.get("x-request-id") or _new_request_id()
    if len(request_id) > 128 or not request_id.isprintable():
        request_id = _new_request_id()
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
        # The turn runs up to its answer (non-streamed) or first chunk (streamed); a client
        # that goes away first cancels its engine calls: nobody would read the result.
        with CancelOnDisconnect(request.receive):
            outcome = await services.runner.run(turn_request)
    except Exception as exc:
        error = type(exc).__name__
        raise
    finally:
        trace.set(path=outcome.path if outcome else "error", turn=turn_request.turn)
        if log.isEnabledFor(logging.INFO):
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
    assert outcome is not None  # the watch raises ClientGone, it never swallows here
    headers = {_PATH_HEADER: str(outcome.path)} if services.config.expose_path_header else {}
    if outcome.chunks is not None:
        done = False

        def finish() -> None:
            nonlocal done
            if not done:
                done = True
                services.in_flight -= 1
                services.metrics.in_flight.set(services.in_flight)
                trace.end()

        return EventStream(outcome.chunks, headers, finish)
    assert outcome.body is not None
    return Answer(outcome.body, headers)


@post("/v1/chat/completions", status_code=200)
async def chat_completions(request: Request[Any, Any, Any]) -> ASGIApp:
    return await _generate(request, chat=True)


@post("/v1/completions", status_code=200)
async def completions(request: Request[Any, Any, Any]) -> ASGIApp:
    return await _generate(request, chat=False)


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
