"""Runs schedules drawn from the run's seed and says which broke what (the tests' helper)."""

from __future__ import annotations

import logging
import os
import random
from collections.abc import Awaitable, Callable

from tests.explore.budget import EXPLORE_SEED
from tests.explore.schedules import Run, Schedule, draw, violations


def seeds(salt: str, count: int) -> list[int]:
    """``count`` schedule seeds of this run, one stream per test (``salt``)."""
    rng = random.Random(f"{os.environ[EXPLORE_SEED]}/{salt}")
    return [rng.randrange(2**32) for _ in range(count)]


async def explore(
    schedules: list[int], runs: Callable[[Schedule], Awaitable[list[Run]]]
) -> tuple[int, list[str]]:
    """Every schedule's runs; how many ran, and each violation with the seed that replays it
    (``draw(seed)``)."""
    found: list[str] = []
    ran = 0
    logging.disable(logging.WARNING)  # thousands of injected failures, each logged
    try:
        for seed in schedules:
            for result in await runs(draw(seed)):
                ran += 1
                found += [f"schedule {seed}: {v}" for v in violations(result)]
    finally:
        logging.disable(logging.NOTSET)
    return ran, found


def report(what: str, ran: int, found: list[str]) -> str:
    seed = os.environ[EXPLORE_SEED]
    shown = "\n".join(found[:10])
    return f"{what}: {ran} runs from seed {seed} ({EXPLORE_SEED}={seed} replays), {len(found)} violations\n{shown}"
