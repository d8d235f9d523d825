"""The end of a turn: D's handle stored for the next one, or released (docs/handles.md)."""

from __future__ import annotations

import logging

from carryover.router.fleet.instance import streams_handles
from carryover.router.fleet.pressure import keeps_new_pins
from carryover.router.handles.fates import Event
from carryover.router.handles.ledger import HeldHandle, Origin
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

__all__ = ["commit", "settle_write"]

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
    if streamed and output.handle is None:
        # A stream that ended without D's handle: the engine API may still get one.
        await req.runtime.api.after_stream(svc, req, prepared, output, decode)
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
        svc.ledger.record(held, Event.NOT_STORABLE, refused)
        return
    ids = prepared.ids if prepared.ids is not None else output.prompt_ids
    assert ids is not None and req.key is not None
    sequence_end = len(ids) + len(output.output_ids)
    try:
        tokens = int(handle.get("remote_num_tokens") or 0)
        block_size = block_size_of(handle, decode.block_size)
    except (ValueError, TypeError):
        svc.ledger.record(held, Event.NOT_STORABLE, ReleaseCause.BAD_HANDLE)
        return
    if not 0 < tokens <= sequence_end:
        svc.ledger.record(held, Event.NOT_STORABLE, ReleaseCause.BAD_HANDLE)
        return
    if not keeps_new_pins(
        decode.kv_usage,
        limit=svc.config.decode_kv_pin_limit,
        pinned_tokens=tokens,
        capacity=decode.kv_capacity,
    ):
        svc.ledger.record(held, Event.NOT_STORABLE, ReleaseCause.DECODE_FULL)
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
    svc.ledger.record(held, Event.WRITING)
    try:
        with timed(svc.metrics, req, "commit"):
            committed = await svc.store.commit(
                req.key, record, now=now, running_for=req.running_for
            )
    except StoreUnavailable as exc:
        # The write may still land when the store answers again: releasing now would leave a
        # stored handle to freed blocks, which the next turn would send to P.
        svc.metrics.store_errors.labels("commit").inc()
        svc.ledger.record(held, Event.STORE_UNKNOWN)
        log.warning("store unavailable, record may not be kept; D frees it at its TTL: %s", exc)
        return
    settle_write(svc, req, held, committed)
    if committed.written and req.chat and output.content:
        # The next turn will send this answer back: the renderer tokenizes its span now, off
        # that turn's time to first token (docs/rendering.md).
        svc.background.run(req.runtime.renderer.warm(req.body, output.content))


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


def settle_write(
    svc: TurnServices, req: TurnRequest, held: HeldHandle, committed: Committed
) -> None:
    """A store write's answer, for the handle it carried and the record it overwrote. One
    overwritten before anyone claimed it was never sent, and nobody else will send it now;
    one the store withheld (not durable) is left to expire."""
    if committed.ended:  # DELETE came while this turn ran: the conversation is over
        svc.ledger.record(held, Event.ENDED)
    else:
        svc.ledger.record(held, Event.WRITTEN if committed.written else Event.SUPERSEDED)
    if committed.replaced is not None:
        replaced = svc.ledger.hold(Origin.REPLACED, committed.replaced.handle, req.release_target)
        svc.ledger.record(replaced, Event.GIVEN_BACK, ReleaseCause.REPLACED)
    elif committed.withheld:
        svc.ledger.lost(Origin.REPLACED, Event.NOT_DURABLE)
