"""How a turn ran, decided in one place: the path it entered with (from prepare's outcome),
then what its attempts noted on the way (:class:`PathNote`), folded once the answer is ready.

Nothing else assigns a :class:`TurnPath`: the stages return notes, and ``X-Carryover-Path``,
the ``path`` label of metrics and the log line all read :func:`final_path`.
"""

from __future__ import annotations

from collections.abc import Iterable
from enum import StrEnum

from carryover.state import Path, Plan, Reason

__all__ = ["REUSED", "PathNote", "TurnPath", "entry_path", "final_path"]


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


def entry_path(
    plan: Plan,
    *,
    conversation: bool,
    checked: bool,
    state_known: bool,
) -> TurnPath:
    """The path a prepared turn starts on. ``checked``: the router rendered and checked the
    prompt's ids (``False``: fields only the engine applies); ``state_known``: the ids,
    the store's claim and the served name were all there to plan with."""
    if not checked:
        return TurnPath.COLD_UNCHECKED
    if not conversation:
        return TurnPath.NO_CONVERSATION
    if not state_known:
        return TurnPath.COLD_ERROR
    if plan.path is Path.REUSE:
        return TurnPath.REUSE
    if plan.path is Path.PARTIAL:
        return TurnPath.PARTIAL
    if plan.path is Path.RELEASE or plan.reason is Reason.BAD_HANDLE:
        return TurnPath.COLD_MISMATCH
    if plan.reason in (Reason.EXPIRED, Reason.STALE_ENGINE):
        return TurnPath.COLD_EXPIRED
    return TurnPath.COLD_MISS


def final_path(entry: TurnPath, notes: Iterable[PathNote]) -> TurnPath:
    """The path after the notes, in the order they were made."""
    path = entry
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
