"""Choosing P and D (router/fleet/policy.py): most of the prompt held wins within the slack when it
saves enough for its extra load; load decides past it, and when nobody holds anything."""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

from carryover.router.config import InstanceConfig, ModelConfig
from carryover.router.fleet.instance import Breaker, Instance
from carryover.router.fleet.policy import Affinity, pick_decode, pick_prefill

MODEL = ModelConfig(prefill=[InstanceConfig("http://p:1")], decode=[InstanceConfig("http://d:1")])


def instance(name: str, in_flight: int) -> Instance:
    return Instance(
        InstanceConfig(f"http://{name}", name=name),
        "decode",
        MODEL,
        Breaker(3, 5.0),
        in_flight=in_flight,
    )


def picks(held: dict[str, int], affinity: Affinity) -> list[Callable[[list[Instance]], Any]]:
    rng = random.Random(0)

    def hold(i: Instance) -> int | None:
        return held.get(i.name)

    return [
        lambda c: pick_prefill(c, rng, held=hold, affinity=affinity),
        lambda c: pick_decode(c, rng, held=hold, affinity=affinity),
    ]


def test_the_holder_of_most_of_the_prompt_wins_within_the_slack() -> None:
    a, b, c = instance("a", 0), instance("b", 3), instance("c", 2)
    held = {"a": 0, "b": 512, "c": 256}
    for pick in picks(held, Affinity(slack=4)):
        assert pick([a, b, c]) is b
    # Past the slack, load overrides: c is within 2 of the least loaded, b is not.
    for pick in picks(held, Affinity(slack=2)):
        assert pick([a, b, c]) is c


def test_a_holder_must_save_enough_tokens_for_its_extra_load() -> None:
    idle, busy = instance("idle", 0), instance("busy", 2)
    # 2 requests busier at 256 tokens each: holding 512 tokens or less is not worth it.
    for pick in picks({"busy": 512}, Affinity(slack=4, tokens_per_load=256)):
        assert pick([idle, busy]) is idle
    for pick in picks({"busy": 640}, Affinity(slack=4, tokens_per_load=256)):
        assert pick([idle, busy]) is busy
    # The idle instance's own holding counts at full value against the busy one's gain.
    for pick in picks({"idle": 128, "busy": 640}, Affinity(slack=4, tokens_per_load=256)):
        assert pick([idle, busy]) is idle
    # The slack stays a ceiling, whatever a holder saves.
    for pick in picks({"busy": 100_000}, Affinity(slack=1, tokens_per_load=256)):
        assert pick([idle, busy]) is idle


def test_without_holdings_the_last_instance_then_load_decides() -> None:
    a, b = instance("a", 0), instance("b", 1)
    rng = random.Random(0)
    assert pick_prefill([a, b], rng, last="b", affinity=Affinity(slack=4)) is b
    # ... unless busier than the slack allows
    assert pick_prefill([a, b], rng, last="b", affinity=Affinity(slack=0)) is a
    assert pick_prefill([a, b], rng, affinity=Affinity(slack=4)) is a
    assert pick_decode([a, b], rng, last="b", affinity=Affinity(slack=4)) is b
    # Nothing known of anyone: the power of two choices picks the less loaded of two.
    assert all(pick_decode([a, b], rng) is a for _ in range(20))


def test_first_turns_spread_over_every_p_whoever_holds_their_shared_prefix() -> None:
    # Only p0 holds the system prompt every conversation starts with: following it would
    # make p0 every conversation's P (their later turns follow their histories there).
    ps = [instance(f"p{i}", 0) for i in range(4)]
    rng = random.Random(0)

    def shared(i: Instance) -> int | None:
        return 1024 if i.name == "p0" else 0

    homes = [
        pick_prefill(ps, rng, held=shared, affinity=Affinity(4, 256), home=f"conv-{n}")
        for n in range(400)
    ]
    counts = {p.name: sum(h is p for h in homes) for p in ps}
    assert all(70 <= n <= 130 for n in counts.values()), counts
    # A conversation's home is its own, in every replica and on every call ...
    again = pick_prefill(
        ps, random.Random(1), held=shared, affinity=Affinity(4, 256), home="conv-7"
    )
    assert again is homes[7]
    # ... among the Ps within the slack of the least loaded.
    busy = [instance(p.name, 5) if p is homes[7] else p for p in ps]
    elsewhere = pick_prefill(busy, rng, held=shared, affinity=Affinity(4, 256), home="conv-7")
    assert elsewhere is not None and elsewhere.name != homes[7].name
    # Without a home (later turns, requests outside a conversation) the holder still wins.
    assert pick_prefill(ps, rng, held=shared, affinity=Affinity(4, 256)) is ps[0]
