"""The handle ledger: every handle the router ever holds reaches exactly one final state.

A handle is in the router's hands when a turn claims its conversation's record, when D hands
one back at the end of a turn, when a commit replaces a record nobody claimed, when pressure
relief claims the oldest records of a full D, and when DELETE takes a record. Each ends as
one of :class:`Fate`: sent to P with a turn, stored for the next turn, released to D (a
one-token P request that frees its blocks), or left for D to free at its TTL because the
router cannot know it is safe to release (docs/handles.md says which, and why).

The ledger is the one place those fates are counted: ``carryover_handles_held_total{origin}``
goes up when a handle is taken, ``carryover_handle_fates_total{fate,cause}`` when it ends,
and ``carryover_handles_open`` is what is held now. Once a router is idle, held equals ended
and nothing is open: the tests check exactly that after every scenario. A second final state
for one handle is a bug: it is counted (``carryover_handle_ledger_errors_total``) and logged,
never applied.
"""

from __future__ import annotations

import logging
from enum import StrEnum

from carryover.router.metrics import RouterMetrics
from carryover.router.outcomes import LeftToExpire, ReleaseCause

__all__ = ["Fate", "HandleLedger", "HeldHandle", "Origin"]

log = logging.getLogger("carryover.handles")


class Origin(StrEnum):
    """How a handle came into the router's hands."""

    CLAIMED = "claimed"  #: a turn claimed its conversation's record
    DECODED = "decoded"  #: D returned it at the end of a turn
    REPLACED = "replaced"  #: a commit overwrote a record nobody had claimed
    RELIEVED = "relieved"  #: pressure relief claimed it from a full D
    ENDED = "ended"  #: DELETE of the conversation took it


class Fate(StrEnum):
    """Where a held handle ended."""

    SENT = "sent"  #: to P with the turn that reused it
    STORED = "stored"  #: in the store, for the conversation's next turn
    RELEASED = "released"  #: given back to D now (cause: ``ReleaseCause``)
    LEFT_TO_EXPIRE = "left_to_expire"  #: for D's TTL to free (cause: ``LeftToExpire``)


class HeldHandle:
    """One handle in the router's hands, until its fate is settled."""

    __slots__ = ("cause", "fate", "origin")

    def __init__(self, origin: Origin) -> None:
        self.origin = origin
        self.fate: Fate | None = None
        self.cause = ""

    @property
    def settled(self) -> bool:
        return self.fate is not None


class HandleLedger:
    def __init__(self, metrics: RouterMetrics) -> None:
        self._metrics = metrics
        self.open = 0  #: held, not yet settled (this process)
        metrics.sampled(metrics.handles_open, lambda: self.open)

    def hold(self, origin: Origin) -> HeldHandle:
        self._metrics.handles_held.labels(origin).inc()
        self.open += 1
        return HeldHandle(origin)

    def sent(self, held: HeldHandle) -> None:
        self._settle(held, Fate.SENT, "")

    def stored(self, held: HeldHandle) -> None:
        self._settle(held, Fate.STORED, "")

    def released(self, held: HeldHandle, cause: ReleaseCause | str) -> None:
        if self._settle(held, Fate.RELEASED, cause):
            self._metrics.releases.labels(cause).inc()

    def left_to_expire(self, held: HeldHandle, cause: LeftToExpire) -> None:
        if self._settle(held, Fate.LEFT_TO_EXPIRE, cause):
            self._metrics.left_to_expire.labels(cause).inc()

    def lost(self, origin: Origin, cause: LeftToExpire, count: int = 1) -> None:
        """Handles that may be in the router's hands (a claim whose outcome is unknown or
        not durable), left to expire the moment they are known of."""
        for _ in range(count):
            self.left_to_expire(self.hold(origin), cause)

    def _settle(self, held: HeldHandle, fate: Fate, cause: str) -> bool:
        if held.fate is not None:
            self._metrics.ledger_errors.inc()
            log.error(
                "a %s handle already %s was to be %s (%s): ignored",
                held.origin,
                held.fate,
                fate,
                cause,
            )
            return False
        held.fate = fate
        held.cause = cause
        self.open -= 1
        self._metrics.handle_fates.labels(fate, cause).inc()
        return True
