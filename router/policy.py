"""Choosing P and D for a turn. Pure functions of the candidates' load; no side effects."""

from __future__ import annotations

import random

from router.pool import Instance

__all__ = ["pick_decode", "pick_prefill"]


def pick_decode(candidates: list[Instance], rng: random.Random) -> Instance | None:
    """Power of two choices on load (in-flight, queued, KV pressure)."""
    if not candidates:
        return None
    if len(candidates) == 1:
        return candidates[0]
    a, b = rng.sample(candidates, 2)
    return a if a.load() <= b.load() else b


def pick_prefill(
    candidates: list[Instance], affinity: str | None, slack: int, rng: random.Random
) -> Instance | None:
    """The P that served the conversation's last turn (its prefix cache likely holds the
    prompt) unless it is more than ``slack`` requests busier than the least loaded P."""
    if not candidates:
        return None
    least = min(candidates, key=lambda i: (i.load(), rng.random()))
    if affinity is not None:
        for instance in candidates:
            if instance.name == affinity and instance.load() <= least.load() + slack:
                return instance
    return least
