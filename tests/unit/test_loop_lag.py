"""The event loop's lag: a timer's lateness, observed as the loop runs; a loop held up by
blocking work shows it."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import time

from carryover.router.loop_lag import watch_loop_lag
from tests.support.waiting import eventually


class _Seen:
    def __init__(self) -> None:
        self.values: list[float] = []

    def observe(self, amount: float) -> None:
        self.values.append(amount)

    async def count(self) -> int:
        return len(self.values)


def _hold_the_loop(seconds: float) -> None:
    """CPU work that never yields: what the gauge exists to show."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


async def test_a_loop_held_up_shows_as_lag() -> None:
    seen = _Seen()
    watching = asyncio.create_task(watch_loop_lag(seen, interval=0.01))
    try:
        await eventually(seen.count, lambda n: n >= 3, what="three timers observed")
        assert all(value >= 0 for value in seen.values)
        before = len(seen.values)
        _hold_the_loop(0.2)
        await eventually(seen.count, lambda n: n > before, what="a timer after the hold")
        assert max(seen.values[before:]) >= 0.15
    finally:
        watching.cancel()


class _ByGeneration:
    def __init__(self) -> None:
        self.seen: dict[str, _Seen] = {}

    def labels(self, generation: str) -> _Seen:
        return self.seen.setdefault(generation, _Seen())


async def test_garbage_collection_passes_are_timed_while_the_watch_runs() -> None:
    passes = _ByGeneration()
    watching = asyncio.create_task(watch_loop_lag(_Seen(), interval=0.01, collections=passes))
    try:
        await eventually(lambda: _now(len(passes.seen)), lambda n: n == 3, what="the watch up")
        gc.collect(1)
        assert len(passes.seen["1"].values) >= 1
        assert all(value >= 0 for value in passes.seen["1"].values)
    finally:
        watching.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await watching
    counted = {generation: len(seen.values) for generation, seen in passes.seen.items()}
    gc.collect()
    assert {generation: len(seen.values) for generation, seen in passes.seen.items()} == counted


async def _now(value: int) -> int:
    return value
