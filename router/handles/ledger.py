"""The handle ledger: every handle the router ever holds reaches exactly one fate, and the
ledger is the one place that carries fates out.

A handle is in the router's hands when a turn claims its conversation's record, when D hands
one back at the end of a turn, when a commit replaces a record nobody claimed, when pressure
relief claims the oldest records of a full D, and when DELETE takes a record. Each ends as
one :class:`Fate`, which :func:`~carryover.router.handles.fates.decide` picks from how far the
handle got and what happened (docs/handles.md). :meth:`HandleLedger.record` carries it out and,
for a release, starts the one-token request that frees D's blocks; nothing else releases a
handle or leaves one to expire.

``carryover_handles_held_total{origin}`` goes up when a handle is taken,
``carryover_handle_fates_total{fate,cause}`` when it ends, and ``carryover_handles_open`` is
what is held now. Once a router is idle, held equals ended and nothing is open. A second
fate for one handle is a bug: it is counted (``carryover_handle_ledger_errors_total``),
logged, and not carried out: a refused release is never sent.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Coroutine
from enum import StrEnum
from typing import Any

from carryover.router.handles.fates import Event, Fate, Stage, decide
from carryover.router.metrics import RouterMetrics

__all__ = ["Fate", "HandleLedger", "HeldHandle", "Origin", "Stage"]

log = logging.getLogger("carryover.handles")

#: Frees D's blocks of a held handle (a one-token P request); ``True`` when P answered.
Release = Callable[["HeldHandle"], Coroutine[Any, Any, bool]]
#: Runs a coroutine to its end whatever happens to the request that started it.
Spawn = Callable[[Coroutine[Any, Any, bool]], Awaitable[bool]]


class Origin(StrEnum):
    """How a handle came into the router's hands."""

    CLAIMED = "claimed"  #: a turn claimed its conversation's record
    DECODED = "decoded"  #: D returned it at the end of a turn
    REPLACED = "replaced"  #: a commit overwrote a record nobody had claimed
    RELIEVED = "relieved"  #: pressure relief claimed it from a full D
    ENDED = "ended"  #: DELETE of the conversation took it


#: Where each origin starts.
_FIRST_STAGE = {
    Origin.CLAIMED: Stage.CLAIMED,
    Origin.DECODED: Stage.DECODED,
    Origin.REPLACED: Stage.TAKEN,
    Origin.RELIEVED: Stage.TAKEN,
    Origin.ENDED: Stage.TAKEN,
}


class HeldHandle:
    """One handle in the router's hands, until its fate is settled: the handle (``kv``,
    ``None`` where it is not known) and what a release goes to (``target``: the model and
    its served name)."""

    __slots__ = ("cause", "fate", "kv", "origin", "stage", "target")

    def __init__(
        self, origin: Origin, stage: Stage, kv: dict[str, Any] | None, target: Any
    ) -> None:
        self.origin = origin
        self.stage = stage
        self.kv = kv
        self.target = target
        self.fate: Fate | None = None
        self.cause = ""

    @property
    def settled(self) -> bool:
        return self.fate is not None

    @property
    def so_far(self) -> str:
        """Its fate so far, as the turn's log line says it: ``held``, ``sent``,
        ``released:superseded``, …"""
        if self.fate is None:
            return "held"
        return f"{self.fate}:{self.cause}" if self.cause else str(self.fate)

    def __repr__(self) -> str:
        return f"HeldHandle({self.origin}, {self.stage}, fate={self.fate}:{self.cause})"


async def _no_release(held: HeldHandle) -> bool:
    return False


async def _inline(work: Coroutine[Any, Any, bool]) -> bool:
    return await work


class HandleLedger:
    def __init__(
        self, metrics: RouterMetrics, release: Release = _no_release, spawn: Spawn = _inline
    ) -> None:
        self._metrics = metrics
        self._release = release
        self._spawn = spawn
        self.open = 0  #: held, not yet settled (this process)
        metrics.sampled(metrics.handles_open, lambda: self.open)

    def hold(
        self,
        origin: Origin,
        kv: dict[str, Any] | None = None,
        target: Any = None,
        *,
        stage: Stage | None = None,
    ) -> HeldHandle:
        self._metrics.handles_held.labels(origin).inc()
        self.open += 1
        return HeldHandle(origin, stage or _FIRST_STAGE[origin], kv, target)

    def record(
        self, held: HeldHandle, event: Event, detail: str | None = None
    ) -> Awaitable[bool] | None:
        """Carry out what the fate table decides for ``event`` at the handle's stage: a move
        to the next stage, or its fate. A release is started at once and runs to its end
        whatever happens to the caller; its result (P answered it) is returned for those
        that wait on it. ``None``: no release (a move, another fate, the decision is not
        this event's to make, or it was refused)."""
        decision, planned = decide(held.stage, event, detail)
        if not planned:
            self._error(held, f"met {event}: no row in the fate table")
        fate, cause = decision.fate, decision.cause or ""
        if decision.stage is not None:
            if held.settled:
                self._error(held, f"moved to {decision.stage}")
            else:
                held.stage = decision.stage
            return None
        if fate is None:
            return None
        if held.fate is not None:
            self._error(held, f"to be {fate} ({cause})")
            return None
        held.fate = fate
        held.cause = cause
        self.open -= 1
        self._metrics.handle_fates.labels(fate, cause).inc()
        if fate is Fate.RELEASED:
            self._metrics.releases.labels(cause).inc()
            if not decision.carried and held.kv is not None:
                return self._spawn(self._release(held))
        elif fate is Fate.LEFT_TO_EXPIRE:
            self._metrics.left_to_expire.labels(cause).inc()
        return None

    def lost(self, origin: Origin, event: Event, count: int = 1) -> None:
        """Handles that may be in the router's hands (a claim whose outcome is unknown or
        not durable), settled the moment they are known of."""
        for _ in range(count):
            self.record(self.hold(origin, stage=Stage.UNKNOWN), event)

    def _error(self, held: HeldHandle, what: str) -> None:
        self._metrics.ledger_errors.inc()
        log.error("a %s handle (%s, %s) was %s: refused", held.origin, held.stage, held.fate, what)
