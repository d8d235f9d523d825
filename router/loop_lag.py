"""How late the worker's event loop runs: every request it serves waits that long beyond its
own work, at each step that waits for the loop (reading a request, each engine answer, the
store). Sampled with a timer, as runtimes such as Node.js report their loop's delay. The
garbage collector's passes, which stop the loop while they run, are timed beside it."""

from __future__ import annotations

import asyncio
import gc
import time
from typing import Any, Protocol

__all__ = ["watch_loop_lag"]

#: How often the timer is set: ten wakeups a second cost nothing beside a turn's work.
INTERVAL = 0.1


class _Observes(Protocol):
    def observe(self, amount: float) -> None: ...


class _ObservesByGeneration(Protocol):
    def labels(self, generation: str) -> _Observes: ...


def _timing(collections: _ObservesByGeneration) -> Any:
    """A ``gc.callbacks`` entry that observes each pass's length by its generation."""
    by_generation = [collections.labels(str(generation)) for generation in range(3)]
    started = 0.0

    def on_pass(phase: str, info: dict[str, int]) -> None:
        nonlocal started
        if phase == "start":
            started = time.perf_counter()
        else:
            by_generation[info["generation"]].observe(time.perf_counter() - started)

    return on_pass


async def watch_loop_lag(
    lag: _Observes,
    interval: float = INTERVAL,
    collections: _ObservesByGeneration | None = None,
) -> None:
    """Forever: set a timer ``interval`` ahead and observe how late it ran; with
    ``collections``, the length of every garbage collection pass meanwhile."""
    loop = asyncio.get_running_loop()
    on_pass = _timing(collections) if collections is not None else None
    if on_pass is not None:
        gc.callbacks.append(on_pass)
    try:
        while True:
            due = loop.time() + interval
            await asyncio.sleep(interval)
            lag.observe(max(0.0, loop.time() - due))
    finally:
        if on_pass is not None:
            gc.callbacks.remove(on_pass)
