"""The end of a turn: D's handle stored for the next one, or released (docs/handles.md)."""

from __future__ import annotations

import logging

from carryover.router.fleet.instance import streams_handles
from carryover.router.fleet.pressure import keeps_new_pins
from carryover.router.handles.fates import Event
from carryover.router.handles.ledger import Origin, Stage
from carryover.router.outcomes import NoHandleCause, ReleaseCause
from carryover.router.relay import DecodeOutput
from carryover.router.turn.model import Prepared, Started, TurnRequest
from carryover.router.turn.prefill_answer import same_ids
from carryover.router.turn.services import TurnServices
from carryover.router.turn.timing import timed
from carryover.state import (
    Committed,
    HashedTokens,
    Record,
    StoreUnavailable,
    block_size_of,
    chunk_size_for,
)

__all__ = ["commit", "release_replaced", "written_event"]

log = logging.getLogger("carryover.turn")


async def commit(
    svc: TurnServices,
    req: TurnRequest,
    prepared: Prepared,
    output: DecodeOutput,
    started: Started,
    *,
    streamed: bool,
) -> None:
    decode = started.decode
    handle = output.handle
    if not isinstance(handle, dict) or not handle.get("do_remote_decode"):
        if output.no_handle is not None:  # the engine API knew why
            cause = output.no_handle
        elif streamed and decode.version is not None and not streams_handles(decode.version):
            cause = NoHandleCause.STREAMED_BEFORE_033
        elif output.stop_reason is not None and isinstance(output.stop_reason, str):
            cause = NoHandleCause.STOP_STRING
        else:
            cause = NoHandleCause.NONE_RETURNED
        svc.metrics.no_handle.labels(cause).inc()
        return
    held = svc.ledger.hold(Origin.DECODED, handle, req.release_target)
    refused = _not_storable(req, prepared, output, started)
    if refused is not None:
        svc.ledger.settle(held, Event.NOT_STORABLE, refused)
        return
    ids = prepared.ids if prepared.ids is not None else output.prompt_ids
    assert ids is not None and req.key is not None
    sequence_end = len(ids) + len(output.output_ids)
    try:
        tokens = int(handle.get("remote_num_tokens") or 0)
        block_size = block_size_of(handle, decode.block_size)
    except (ValueError, TypeError):
        svc.ledger.settle(held, Event.NOT_STORABLE, ReleaseCause.BAD_HANDLE)
        return
    if not 0 < tokens <= sequence_end:
        svc.ledger.settle(held, Event.NOT_STORABLE, ReleaseCause.BAD_HANDLE)
        return
    if not keeps_new_pins(
        decode.kv_usage,
        limit=svc.config.decode_kv_pin_limit,
        pinned_tokens=tokens,
        capacity=decode.kv_capacity,
    ):
        svc.ledger.settle(held, Event.NOT_STORABLE, ReleaseCause.DECODE_FULL)
        return
    chunk = chunk_size_for(block_size)
    hashed = prepared.hashed
    if hashed is not None and hashed.chunk_size == chunk:
        sequence = hashed.extended(output.output_ids)
    else:
        sequence = HashedTokens([*ids, *output.output_ids], chunk)
    now = svc.clock()
    record = Record(
        turn=req.turn or 1,
        handle=handle,
        decode=decode.name,
        decode_epoch=decode.epoch,
        prefill=started.prefill.name if started.prefill is not None else None,
        block_size=block_size,
        prefix=sequence.prefix(tokens, output_start=len(ids)),
        created_at=now,
        expires_at=now + req.model.record_ttl,
        shadowed=output.shadowed,
    )
    svc.ledger.move(held, Stage.WRITING)
    try:
        with timed(svc.metrics, req, "commit"):
            committed = await svc.store.commit(
                req.key, record, now=now, running_for=req.running_for
            )
    except StoreUnavailable as exc:
        # The write may still land when the store answers again: releasing now would leave a
        # stored handle to freed blocks, which the next turn would send to P.
        svc.metrics.store_errors.labels("commit").inc()
        svc.ledger.settle(held, Event.STORE_UNKNOWN)
        log.warning("store unavailable, record may not be kept; D frees it at its TTL: %s", exc)
        return
    svc.ledger.settle(held, written_event(committed))
    if committed.written and req.chat and output.content:
        # The next turn will send this answer back: the renderer tokenizes its span now, off
        # that turn's time to first token (docs/rendering.md).
        svc.background.run(_warm_renderer(req, output.content))
    release_replaced(svc, req, committed)


def written_event(committed: Committed) -> Event:
    """What a store write's answer was, for the handle it carried."""
    if committed.ended:  # DELETE came while this turn ran: the conversation is over
        return Event.ENDED
    return Event.WRITTEN if committed.written else Event.SUPERSEDED


async def _warm_renderer(req: TurnRequest, answer: str) -> bool:
    try:
        await req.runtime.renderer.warm(req.body, answer)
    except Exception:  # a warm-up that fails costs the next turn's speed only
        log.debug("render warm-up failed", exc_info=True)
        return False
    return True


def _not_storable(
    req: TurnRequest, prepared: Prepared, output: DecodeOutput, started: Started
) -> ReleaseCause | None:
    """Why D's handle cannot be stored for the next turn, if it cannot."""
    if not req.reuses:
        return ReleaseCause.NO_CONVERSATION
    if not prepared.storable:
        return ReleaseCause.IDS_DO_NOT_DETERMINE_KV
    if prepared.ids is not None and not output.ran(prepared.ids, prepared.ids_json):
        # The record would describe the checked ids, the blocks hold what D ran.
        log.warning(
            "decode instance %s ran other prompt ids than were checked", started.decode.name
        )
        return ReleaseCause.DECODE_PROMPT_MISMATCH
    ran = prepared.ids if prepared.ids is not None else output.prompt_ids
    if ran is None:
        return ReleaseCause.NO_PROMPT_IDS
    checked_json = prepared.ids_json if prepared.ids is not None else None
    if started.prefill_ran is not None and not same_ids(started.prefill_ran, ran, checked_json):
        # D's prompt KV came from P: computed from other ids than the record would say (a P
        # that ignores forwarded ids, or an unchecked turn P rendered differently).
        log.warning("a prefill instance ran other prompt ids than decode was given")
        return ReleaseCause.PREFILL_PROMPT_MISMATCH
    return None


def release_replaced(svc: TurnServices, req: TurnRequest, committed: Committed) -> None:
    """A record overwritten before anyone claimed it: its handle was never sent, and nobody
    else will send it now. One the store withheld (not durable) is left to expire."""
    if committed.replaced is not None:
        held = svc.ledger.hold(Origin.REPLACED, committed.replaced.handle, req.release_target)
        svc.ledger.settle(held, Event.GIVEN_BACK, ReleaseCause.REPLACED)
    elif committed.withheld:
        svc.ledger.lost(Origin.REPLACED, Event.NOT_DURABLE)
