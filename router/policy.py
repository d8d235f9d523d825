"""Choosing P and D for a turn. Pure functions of the candidates' load and of what each one
already holds of the prompt; no side effects.

Both legs follow one rule (docs/kv-events.md): among the instances at most ``slack`` requests
busier than the least loaded one, the one holding the most of the prompt wins; load decides
when none holds any of it. Without an index, the instance of the conversation's last turn
stands in for "holds the most" (its prefix cache likely does).
"""

from __future__ import annotations

import random
from collections.abc import Callable

from router.pool import Instance

__all__ = ["pick_decode", "pick_prefill"]

#: Tokens of the prompt an instance holds, or ``None`` when nothing is known of it.
Held = Callable[[Instance], int | None]


def _nothing_known(_: Instance) -> int | None:
    return None


def _by_holding(
    candidates: list[Instance], held: Held, affinity: str | None, slack: int, least: Instance
) -> Instance | None:
    ceiling = least.load() + slack
    eligible = [i for i in candidates if i.load() <= ceiling]
    scored = [(held(i) or 0, i) for i in eligible]
    best = max(scored, key=lambda s: (s[0], -s[1].load()), default=None)
    if best is not None and best[0] > 0:
        return best[1]
    for instance in eligible:
        if instance.name == affinity:
            return instance
    return None


def pick_decode(
    candidates: list[Instance],
    rng: random.Random,
    *,
    held: Held = _nothing_known,
    affinity: str | None = None,
    slack: int = 0,
) -> Instance | None:
    """The D holding most of the prompt within ``slack`` of the least load; else power of two
    choices on load (in-flight, queued, KV pressure)."""
    if not candidates:
        return None
    if len(candidates) == 1:
        return candidates[0]
    least = min(candidates, key=lambda i: (i.load(), rng.random()))
    chosen = _by_holding(candidates, held, affinity, slack, least)
    if chosen is not None:
        return chosen
    a, b = rng.sample(candidates, 2)
    return a if a.load() <= b.load() else b


def pick_prefill(
    candidates: list[Instance],
    affinity: str | None,
    slack: int,
    rng: random.Random,
    *,
    held: Held = _nothing_known,
) -> Instance | None:
    """The P holding most of the prompt (else the conversation's last P) unless it is more
    than ``slack`` requests busier than the least loaded P; else the least loaded."""
    if not candidates:
        return None
    least = min(candidates, key=lambda i: (i.load(), rng.random()))
    return _by_holding(candidates, held, affinity, slack, least) or least
