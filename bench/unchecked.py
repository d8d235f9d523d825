"""The planner of the benchmark's ``carryover-unchecked`` arm: reuse the stored handle whole
whenever it is live, without comparing tokens. It measures what the prefix check prevents
(wrong answers); no deployment should run it. Injected with ``carryover serve --planner
bench.unchecked:plan_unchecked``."""

from __future__ import annotations

from collections.abc import Sequence

from carryover.state import HashedTokens, Path, Plan, PlanSettings, Reason, Record

__all__ = ["plan_unchecked"]


def plan_unchecked(
    record: Record | None,
    prompt: Sequence[int] | HashedTokens,
    *,
    now: float,
    decode_epoch: int | None,
    settings: PlanSettings,
) -> Plan:
    if record is None:
        return Plan(Path.COLD, Reason.NO_RECORD)
    if record.expired(now) or decode_epoch is None or record.decode_epoch < decode_epoch:
        return Plan(Path.COLD, Reason.EXPIRED)
    tokens = int(record.handle.get("remote_num_tokens") or 0)
    return Plan(Path.REUSE, None, record.handle, tokens)
