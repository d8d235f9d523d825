"""Choosing P and D for a turn. Pure functions of the candidates' load and of what each one
already holds of the prompt; no side effects.

Both legs follow one rule (docs/kv-events.md): among the instances at most ``slack`` requests
busier than the least loaded one, the one with the best gain wins, where the gain is the
prompt tokens an instance holds less ``tokens_per_load`` for each request of load it has above
the least loaded. A holder is thus worth its extra load only when it saves enough of the
prompt; load decides when nobody's gain is positive. Without an index, the instance of the
conversation's last turn stands in for "holds the most" (its prefix cache likely does). A
conversation's first P leg goes where its id hashes (``pick_prefill``'s ``home``).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

import xxhash

from carryover.router.fleet.instance import Instance

__all__ = ["Affinity", "Held", "nothing_known", "pick_decode", "pick_prefill"]

#: Tokens of the prompt an instance holds, or ``None`` when nothing is known of it.
Held = Callable[[Instance], int | None]


def nothing_known(_: Instance) -> int | None:
    return None


@dataclass(frozen=True, slots=True)
class Affinity:
    """How much load a KV holder may carry and still be preferred.

    Attributes:
        slack: the most requests busier than the least loaded instance any holder may be.
        tokens_per_load: prompt tokens a holder must save for each request of load it has
            above the least loaded; 0 makes any holding win within the slack.
    """

    slack: int = 0
    tokens_per_load: int = 0


def _by_holding(
    candidates: list[Instance], held: Held, last: str | None, affinity: Affinity, least: Instance
) -> Instance | None:
    floor = least.load()
    eligible = [i for i in candidates if i.load() <= floor + affinity.slack]
    holdings = [(held(i) or 0, i) for i in eligible]
    if any(tokens > 0 for tokens, _ in holdings):
        gains = [
            (tokens - affinity.tokens_per_load * (i.load() - floor), i) for tokens, i in holdings
        ]
        gain, best = max(gains, key=lambda g: (g[0], -g[1].load()))
        # No holder saves enough for its load: the caller decides by load alone.
        return best if gain > 0 else None
    for instance in eligible:
        if instance.name == last:
            return instance
    return None


def pick_decode(
    candidates: list[Instance],
    rng: random.Random,
    *,
    held: Held = nothing_known,
    last: str | None = None,
    affinity: Affinity = Affinity(),
) -> Instance | None:
    """The D with the best gain within the slack of the least load (else the conversation's
    last D); else power of two choices on load (in-flight, queued, KV pressure)."""
    if not candidates:
        return None
    if len(candidates) == 1:
        return candidates[0]
    least = min(candidates, key=lambda i: (i.load(), rng.random()))
    chosen = _by_holding(candidates, held, last, affinity, least)
    if chosen is not None:
        return chosen
    a, b = rng.sample(candidates, 2)
    return a if a.load() <= b.load() else b


def _home(conversation: str, instance: Instance) -> int:
    """Rendezvous hashing: each conversation ranks the instances its own way, the same in
    every router replica, and keeps its rank when instances come or go."""
    return xxhash.xxh3_64_intdigest(f"{conversation}\0{instance.name}".encode())


def pick_prefill(
    candidates: list[Instance],
    rng: random.Random,
    *,
    held: Held = nothing_known,
    last: str | None = None,
    affinity: Affinity = Affinity(),
    home: str | None = None,
) -> Instance | None:
    """The P with the best gain within the slack of the least load (else the conversation's
    last P); else the least loaded.

    ``home``: the conversation of a first turn, which goes to the P its id hashes to among
    those within the slack, whatever P holds a shared prefix of it. Its later turns follow
    its history there (the gain), so following a shared system prompt's holder would make
    that one P every conversation's: its compute the queue and its prefix cache too small for
    their histories, while the other Ps idle (bench/RESULTS.md, chat at 500 conversations).
    Each P computes a shared prefix once and holds it from then on."""
    if not candidates:
        return None
    least = min(candidates, key=lambda i: (i.load(), rng.random()))
    if home is not None:
        floor = least.load()
        eligible = [i for i in candidates if i.load() <= floor + affinity.slack]
        return max(eligible, key=lambda i: _home(home, i))
    return _by_holding(candidates, held, last, affinity, least) or least
