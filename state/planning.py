"""``plan()``: a stored record and a new prompt in, what to send to P out."""

from __future__ import annotations

from collections.abc import Sequence

from carryover.state.prefix import (
    DEFAULT_SETTINGS,
    HashedTokens,
    Path,
    Plan,
    PlanSettings,
    Reason,
    plan_reuse,
)
from carryover.state.records import Record

__all__ = ["plan"]


def plan(
    record: Record | None,
    prompt: Sequence[int] | HashedTokens,
    *,
    now: float,
    decode_epoch: int | None,
    settings: PlanSettings = DEFAULT_SETTINGS,
) -> Plan:
    """Decide, for a claimed record, how much KV the new prompt may pull from D.

    Args:
        record: the claimed record, or ``None`` when there was none.
        prompt: the exact token ids P and D will run (or them already hashed with the record's
            chunk size).
        now: wall-clock seconds (the clock the record's ``expires_at`` was written with).
        decode_epoch: the current epoch of the record's decode instance as this router knows
            it; ``None`` when that instance is no longer known to the router (also stale). A
            record of a later epoch is not stale: another replica saw the restart first and
            wrote it since.
        settings: partial reuse on/off and the recompute threshold.

    Returns:
        A :class:`Plan`. An expired or stale record is cold: its blocks are gone or about to be,
        and P would answer a read of them with an error.
    """
    if record is None:
        return Plan(Path.COLD, Reason.NO_RECORD)
    if record.expired(now):
        return Plan(Path.COLD, Reason.EXPIRED)
    if decode_epoch is None or record.decode_epoch < decode_epoch:
        return Plan(Path.COLD, Reason.STALE_ENGINE)
    hashed = (
        prompt
        if isinstance(prompt, HashedTokens) and prompt.chunk_size == record.prefix.chunk_size
        else HashedTokens(
            prompt.tokens() if isinstance(prompt, HashedTokens) else prompt,
            record.prefix.chunk_size,
        )
    )
    return plan_reuse(record.prefix, record.handle, record.block_size, hashed, settings)
