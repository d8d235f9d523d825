"""The D leg: one attempt loop for streamed and whole answers, then the answer itself.

An attempt runs the P leg, picks D and sends it the client's body with P's dict; it is over
once D answered (whole) or sent its first chunk (streamed). A failure before that runs the
turn again on another D with a fresh cold P leg, once.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import AsyncGenerator

from carryover.router.errors import (
    EngineFailed,
    EngineTimeout,
    EngineUnavailable,
    UpstreamError,
    is_client_fault,
    sse_error,
)
from carryover.router.fleet.instance import Instance
from carryover.router.fleet.policy import pick_decode
from carryover.router.handles.fates import Event
from carryover.router.handles.ledger import HeldHandle, Origin
from carryover.router.outcomes import RetryCause
from carryover.router.relay import DecodeOutput, decode_answer
from carryover.router.turn.commit import commit
from carryover.router.turn.costs import decode_local_pays
from carryover.router.turn.model import NOTHING_HELD, PrefillOutcome, Prepared, Started, TurnRequest
from carryover.router.turn.path import PathNote
from carryover.router.turn.placement import LegChoice
from carryover.router.turn.prefill import run_prefill
from carryover.router.turn.services import TurnServices
from carryover.router.turn.timing import timed

__all__ = ["complete", "start", "stream"]

log = logging.getLogger("carryover.turn")


def _pick_decode(
    svc: TurnServices,
    req: TurnRequest,
    prepared: Prepared,
    tried: set[Instance],
    timed_out: set[Instance],
) -> Instance:
    """The D holding most of the prompt (docs/kv-events.md), another than those tried if
    there is one, else one tried again: a retry after a dropped connection on the only D is
    better than a certain 503. One that timed out is not tried again (the client has waited
    long enough)."""
    choose = functools.partial(
        pick_decode,
        rng=svc.rng,
        held=prepared.kv.holding,
        last=prepared.record.decode if prepared.record is not None else None,
        affinity=svc.affinity,
    )
    instance = choose(svc.pool.available(req.model, "decode", tried))
    if instance is None:
        again = svc.pool.available(req.model, "decode", timed_out)
        instance = choose([i for i in again if i in tried])
    if instance is None:
        raise EngineUnavailable(f"no healthy decode instance for {req.model_name}")
    return instance


def _decode_local(
    svc: TurnServices, req: TurnRequest, prepared: Prepared, tried: set[Instance]
) -> Instance | None:
    """The D to run this turn alone, if the index says it holds all of the prompt but at
    most ``decode_local_max_tokens`` (docs/kv-events.md), and computing the rest there costs
    less than a P leg, D's running streams' stall counted (docs/turn-costs.md). D computes the
    rest from its own prefix cache; no P leg, no pull."""
    limit = req.model.decode_local_max_tokens
    kv_view = prepared.kv
    if limit <= 0 or kv_view.prompt is None or prepared.ids is None:
        return None
    decode = _pick_decode(svc, req, prepared, tried, set())
    cached = kv_view.cached(decode)
    prompt = len(prepared.ids)
    if cached is None or cached.tokens == 0 or prompt - cached.tokens > limit:
        return None
    prefill_holds = max(
        (kv_view.on_device(p) for p in svc.pool.available(req.model, "prefill")),
        default=0,
    )
    handle = prepared.plan.reused_tokens if prepared.plan.attaches_handle else 0
    running = max(decode.in_flight, decode.running)
    if not decode_local_pays(
        prompt, cached.tokens, running, prefill_holds, handle, req.model.costs
    ):
        return None
    return decode


async def start(svc: TurnServices, req: TurnRequest, prepared: Prepared) -> Started:
    """Run attempts until one gets D's answer or first chunk: each a P leg (or none, when D
    runs the turn alone) and a D leg; a D that fails is left for another, once, with what
    the turn still holds after the attempt before."""
    tried: set[Instance] = set()
    timed_out: set[Instance] = set()
    last: UpstreamError | None = None
    plan = prepared.plan
    notes: tuple[PathNote, ...] = ()
    placed: dict[str, LegChoice] = {}
    for attempt in range(2):
        local = _decode_local(svc, req, prepared, tried) if attempt == 0 else None
        # A decode-local turn does not need the claimed handle; D's pin is released once D
        # has answered (before that, the pinned blocks keep the history from being evicted).
        unneeded: HeldHandle | None = None
        prefill = PrefillOutcome(None, None, None, plan, notes)
        if local is not None:
            if plan.handle is not None and prepared.claimed is not None:
                unneeded = prepared.claimed
                svc.ledger.record(unneeded, Event.DECODE_LOCAL)
            plan, notes = NOTHING_HELD, (*notes, PathNote.DECODE_LOCAL)
            decode = local
        else:
            prefill = await run_prefill(svc, req, prepared, plan, notes)
            plan, notes = prefill.plan, prefill.notes
            if prefill.choice is not None:
                placed["prefill"] = prefill.choice
            decode = _pick_decode(svc, req, prepared, tried, timed_out)
        placed["decode"] = prepared.kv.choice("decode", decode)
        path, body = req.runtime.api.decode(req, prepared, prefill.params)
        url = f"{decode.url}{path}"
        held = contextlib.AsyncExitStack()
        lease = held.enter_context(svc.pool.lease(decode, req.tenant))
        started = functools.partial(
            Started,
            decode,
            prefill.instance,
            lease,
            held,
            notes,
            dict(placed),
            prefill.ran,
        )
        try:
            if req.stream:
                response = await held.enter_async_context(
                    svc.upstream.stream(
                        url,
                        body,
                        first_byte=svc.config.timeouts.first_byte,
                        headers=req.engine_headers,
                    )
                )
                events = response.events(svc.config.timeouts.first_byte)
                first = await anext(events)
                if unneeded is not None:
                    svc.ledger.record(unneeded, Event.D_DONE)
                return started(first=first, events=events)
            with timed(svc.metrics, req, "decode", **{"carryover.instance": decode.name}):
                answer = await svc.upstream.post_json(
                    url,
                    body,
                    timeout=svc.config.timeouts.request,
                    headers=req.engine_headers,
                    decode=decode_answer,
                )
            if unneeded is not None:
                svc.ledger.record(unneeded, Event.D_DONE)
            return started(answer=answer)
        except (UpstreamError, StopAsyncIteration) as exc:
            await held.aclose()
            if unneeded is not None:
                svc.ledger.record(unneeded, Event.D_DONE)
            if is_client_fault(exc):
                raise
            error = exc if isinstance(exc, UpstreamError) else EngineFailed("empty stream")
            lease.failed(error)
            svc.metrics.retries.labels(RetryCause.DECODE_FAILED).inc()
            tried.add(decode)
            if isinstance(exc, EngineTimeout):
                timed_out.add(decode)
            plan, notes = NOTHING_HELD, (*notes, PathNote.REUSE_LOST)
            last = error
            log.warning("decode attempt %d failed: %s", attempt + 1, error.message)
        except BaseException:  # cancelled (the client left): the lease and connection go too
            await held.aclose()
            raise
    assert last is not None
    raise last


async def complete(
    svc: TurnServices, req: TurnRequest, prepared: Prepared, started: Started
) -> bytes:
    async with started.held:
        started.lease.succeeded()
        if not isinstance(started.answer, dict):
            raise EngineFailed("decode instance answered with a non-object body")
    output = DecodeOutput(client_wants_ids=req.client_wants_ids)
    output.collect(started.answer)
    # D's handle is the router's from here: stored or released even if the client leaves.
    await asyncio.shield(
        svc.background.run(commit(svc, req, prepared, output, started, streamed=False))
    )
    data = await req.runtime.api.answer(svc, req, prepared, started.answer, output)
    elapsed = time.monotonic() - req.started
    svc.metrics.e2e.labels("false").observe(elapsed)
    svc.metrics.answered.labels(req.model_label, req.turn_label, "false").observe(elapsed)
    return data


async def stream(
    svc: TurnServices, req: TurnRequest, prepared: Prepared, started: Started
) -> AsyncGenerator[bytes, None]:
    """The client's SSE frames; ``[DONE]`` is not among them (the response adds it once the
    relay is over: after the commit, or after an error event)."""
    output = DecodeOutput(client_wants_ids=req.client_wants_ids)
    frames = req.runtime.api.frames(svc, req, prepared, started, output)
    # A span over the whole stream, first byte to [DONE].
    started.held.enter_context(
        timed(svc.metrics, req, "decode", **{"carryover.instance": started.decode.name})
    )
    async with started.held:
        try:
            first = True
            async for frame in frames:
                if first:
                    # Before the frame leaves: a scrape that counts the turn (the runner does
                    # once it has this frame) holds its time to first token too.
                    first = False
                    svc.metrics.ttft.labels(req.model_label, req.turn_label).observe(
                        time.monotonic() - req.started
                    )
                yield frame
            started.lease.succeeded()
        except UpstreamError as exc:
            # Mid-stream: the client gets an error event (and [DONE]), never a cut stream.
            started.lease.failed(exc)
            svc.metrics.stream_errors.labels(req.model_label, exc.error_type).inc()
            log.warning("decode stream failed mid-way: %s", exc.message)
            _settle_unfinished(svc, req, output, Event.STREAM_BROKEN)
            yield sse_error(exc)
            return
        except BaseException:
            # The client left mid-stream, perhaps after the chunk carrying D's handle: that
            # turn is not stored (its client never read it all), so the handle is given back.
            _settle_unfinished(svc, req, output, Event.CLIENT_GONE)
            raise
        finally:
            await frames.aclose()
        # D's handle is the router's from here: captured, stored or released even if the
        # client leaves now.
        await asyncio.shield(
            svc.background.run(commit(svc, req, prepared, output, started, streamed=True))
        )
        elapsed = time.monotonic() - req.started
        svc.metrics.e2e.labels("true").observe(elapsed)
        svc.metrics.answered.labels(req.model_label, req.turn_label, "true").observe(elapsed)


def _settle_unfinished(
    svc: TurnServices, req: TurnRequest, output: DecodeOutput, event: Event
) -> None:
    """A stream that ended before its commit, after the chunk carrying D's handle (it broke,
    or the client left): that turn is not stored, so its blocks are given back."""
    handle = output.handle
    if isinstance(handle, dict) and handle.get("do_remote_decode"):
        held = svc.ledger.hold(Origin.DECODED, handle, req.release_target)
        svc.ledger.record(held, event)
