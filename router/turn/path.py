"""How a turn ran, decided in one place: what prepare knew (:class:`Entry`), then what its
attempts noted on the way (:class:`PathNote`), folded once the answer is ready.

Nothing else assigns a :class:`TurnPath`: the stages return notes, and ``X-Carryover-Path``,
the ``path`` label of metrics and the log line all read :func:`final_path`.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from enum import StrEnum

from carryover.state import Path, Plan, Reason

__all__ = ["REUSED", "Entry", "PathNote", "TurnPath", "final_path"]


class TurnPath(StrEnum):
    """How a turn ran (``X-Carryover-Path``, the ``path`` label of metrics, logs)."""

    REUSE = "reuse"  #: the whole stored handle
    PARTIAL = "partial"  #: the handle cut to the blocks before a divergence
    COLD_MISS = "cold-miss"  #: no record
    #: no conversation id: nothing to keep or reuse (a turn of nothing)
    NO_CONVERSATION = "no-conversation"
    COLD_MISMATCH = "cold-mismatch"  #: nothing reusable: the handle was released
    COLD_EXPIRED = "cold-expired"  #: the record's decode instance restarted, or it expired
    COLD_ERROR = "cold-error"  #: store or render down, or P refused the handle
    COLD_UNCHECKED = "cold-unchecked"  #: fields the engine applies itself: nothing checked
    DECODE_LOCAL = "decode-local"  #: D held the prefix and the rest was short: no P leg
    #: no handle, and P loads the start of the prompt from the model's warm tier (LMCache)
    WARM = "warm"
    #: P's own cache held all but a few of the handle's tokens: handle given back, P computed
    PREFILL_CACHE = "prefill-cache"


#: The paths on which P got the plan's tokens from D's handle.
REUSED = frozenset({TurnPath.REUSE, TurnPath.PARTIAL})


class PathNote(StrEnum):
    """What an attempt of the turn saw that changes how the turn ran."""

    #: P's own cache held the handle's tokens: the handle went with nothing to pull
    PULL_WASTED = "pull-wasted"
    #: an engine failed or was missing: what follows runs without the planned reuse
    REUSE_LOST = "reuse-lost"
    #: a P leg without a handle loads more of the prompt from the warm tier than P holds
    WARM_LOADED = "warm-loaded"
    #: D runs the turn alone from its own prefix cache
    DECODE_LOCAL = "decode-local"


@dataclass(frozen=True, slots=True)
class Entry:
    """What a prepared turn knew before any engine ran. ``checked``: the router rendered and
    checked the prompt's ids (``False``: fields only the engine applies); ``state_known``:
    the ids, the store's claim and the served name were all there to plan with."""

    plan: Plan
    conversation: bool
    checked: bool
    state_known: bool


def final_path(entry: Entry, notes: Iterable[PathNote]) -> TurnPath:
    """The path a prepared turn starts on, then the notes in the order they were made."""
    plan = entry.plan
    if not entry.checked:
        path = TurnPath.COLD_UNCHECKED
    elif not entry.conversation:
        path = TurnPath.NO_CONVERSATION
    elif not entry.state_known:
        path = TurnPath.COLD_ERROR
    elif plan.path is Path.REUSE:
        path = TurnPath.REUSE
    elif plan.path is Path.PARTIAL:
        path = TurnPath.PARTIAL
    elif plan.path is Path.RELEASE or plan.reason is Reason.BAD_HANDLE:
        path = TurnPath.COLD_MISMATCH
    elif plan.reason in (Reason.EXPIRED, Reason.STALE_ENGINE):
        path = TurnPath.COLD_EXPIRED
    else:
        path = TurnPath.COLD_MISS
    for note in notes:
        if note is PathNote.PULL_WASTED:
            path = TurnPath.PREFILL_CACHE
        elif note is PathNote.REUSE_LOST:
            path = TurnPath.COLD_ERROR
        elif note is PathNote.DECODE_LOCAL:
            path = TurnPath.DECODE_LOCAL
        elif path is not TurnPath.COLD_UNCHECKED:  # WARM_LOADED
            path = TurnPath.WARM
    return path
