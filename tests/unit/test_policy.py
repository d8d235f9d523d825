"""Choosing P and D (router/policy.py): most of the prompt held wins within the slack; load
decides past it, and when nobody holds anything."""

from __future__ import annotations

import random

from router.config import InstanceConfig, ModelConfig
from router.policy import pick_decode, pick_prefill
from router.pool import Breaker, Instance

MODEL = ModelConfig(prefill=[InstanceConfig("http://p:1")], decode=[InstanceConfig("http://d:1")])


def instance(name: str, in_flight: int) -> Instance:
    return Instance(
        InstanceConfig(f"http://{name}", name=name),
        "decode",
        MODEL,
        Breaker(3, 5.0),
        in_flight=in_flight,
    )


def test_the_holder_of_most_of_the_prompt_wins_within_the_slack() -> None:
    a, b, c = instance("a", 0), instance("b", 3), instance("c", 2)
    held = {"a": 0, "b": 512, "c": 256}.get
    rng = random.Random(0)
    for pick in (
        lambda: pick_prefill([a, b, c], None, 4, rng, held=lambda i: held(i.name)),
        lambda: pick_decode([a, b, c], rng, held=lambda i: held(i.name), slack=4),
    ):
        assert pick() is b
    # Past the slack, load overrides: c is within 2 of the least loaded, b is not.
    assert pick_prefill([a, b, c], None, 2, rng, held=lambda i: held(i.name)) is c
    assert pick_decode([a, b, c], rng, held=lambda i: held(i.name), slack=2) is c


def test_without_holdings_the_last_instance_then_load_decides() -> None:
    a, b = instance("a", 0), instance("b", 1)
    rng = random.Random(0)
    assert pick_prefill([a, b], "b", 4, rng) is b  # the conversation's last P
    assert pick_prefill([a, b], "b", 0, rng) is a  # unless busier than the slack allows
    assert pick_prefill([a, b], None, 4, rng) is a
    assert pick_decode([a, b], rng, affinity="b", slack=4) is b
    # Nothing known of anyone: the power of two choices picks the less loaded of two.
    assert all(pick_decode([a, b], rng) is a for _ in range(20))
