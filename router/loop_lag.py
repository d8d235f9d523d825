"""How late the worker's event loop runs: every request it serves waits that long beyond its
own work, at each step that waits for the loop (reading a request, each engine answer, the
store). Sampled with a timer, as runtimes such as Node.js report their loop's delay. The
garbage collector's passes, which stop the loop while they run, are timed beside it."""

from __future__ import annotations

import asyncio
import gc
import time
from collections import deque
from typing import Protocol

__all__ = ["watch_loop_lag"]

#: How often the timer is set: ten wakeups a second cost nothing beside a turn's work.
INTERVAL = 0.1


class _Observes(Protocol):
    def observe(self, amount: float) -> None: ...


class _ObservesByGeneration(Protocol):
    def labels(self, generation: str) -> _Observes: ...


class _Passes:
    """Each garbage collection pass's length, noted by a ``gc.callbacks`` entry and observed
    later on the loop. The callback only appends to a deque: a pass can start inside any
    allocation, including one made while a metric's lock is held (prometheus_client's
    multiprocess mode has one lock for every value in the process), so observing there could
    wait on that lock forever."""

    def __init__(self, into: _ObservesByGeneration) -> None:
        self._into = into
        self._pending: tuple[deque[float], ...] = tuple(deque(maxlen=10_000) for _ in range(3))
        self._started = 0.0

    def __call__(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        else:
            self._pending[info["generation"]].append(time.perf_counter() - self._started)

    def observe(self) -> None:
        for generation, lengths in enumerate(self._pending):
            while lengths:
                self._into.labels(str(generation)).observe(lengths.popleft())


async def watch_loop_lag(
    lag: _Observes,
    interval: float = INTERVAL,
    collections: _ObservesByGeneration | None = None,
) -> None:
    """Forever: set a timer ``interval`` ahead and observe how late it ran; with
    ``collections``, the length of every garbage collection pass since the last timer."""
    loop = asyncio.get_running_loop()
    passes = _Passes(collections) if collections is not None else None
    if passes is not None:
        gc.callbacks.append(passes)
    try:
        while True:
            due = loop.time() + interval
            await asyncio.sleep(interval)
            lag.observe(max(0.0, loop.time() - due))
            if passes is not None:
                passes.observe()
    finally:
        if passes is not None:
            gc.callbacks.remove(passes)
