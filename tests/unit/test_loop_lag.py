"""The event loop's lag: a timer's lateness, observed as the loop runs; a loop held up by
blocking work shows it."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import threading
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

        async def collected() -> int:
            gc.collect(1)  # until the watch has its callback in place
            return len(passes.labels("1").values)

        await eventually(collected, lambda n: n >= 1, what="a pass seen")
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


class _Locked(_Seen):
    """A histogram child behind a lock, as prometheus_client's values are: one lock for all
    of them in multiprocess mode."""

    def __init__(self, lock: threading.Lock, waited_too_long: list[float]) -> None:
        super().__init__()
        self.lock, self.waited_too_long = lock, waited_too_long

    def observe(self, amount: float) -> None:
        if not self.lock.acquire(timeout=0.5):  # where the router's worker would hang
            self.waited_too_long.append(amount)
            return
        try:
            super().observe(amount)
        finally:
            self.lock.release()


async def test_a_pass_that_starts_while_a_metric_is_locked_does_not_wait_for_it() -> None:
    lock, waited_too_long = threading.Lock(), []
    children = {str(g): _Locked(lock, waited_too_long) for g in range(3)}

    class ByGeneration:
        def labels(self, generation: str) -> _Locked:
            return children[generation]

    watching = asyncio.create_task(
        watch_loop_lag(_Seen(), interval=0.01, collections=ByGeneration())
    )
    try:

        async def collected() -> int:
            with lock:  # a metric's operation allocates, and a pass starts
                gc.collect(0)
            return len(children["0"].values)

        await eventually(collected, lambda n: n >= 1 or waited_too_long, what="a pass observed")
        assert waited_too_long == []
    finally:
        watching.cancel()
