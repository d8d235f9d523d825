"""How late the worker's event loop runs: every request it serves waits that long beyond its
own work, at each step that waits for the loop (reading a request, each engine answer, the
store). Sampled with a timer, as runtimes such as Node.js report their loop's delay."""

from __future__ import annotations

import asyncio
from typing import Protocol

__all__ = ["watch_loop_lag"]

#: How often the timer is set: ten wakeups a second cost nothing beside a turn's work.
INTERVAL = 0.1


class _Observes(Protocol):
    def observe(self, amount: float) -> None: ...


async def watch_loop_lag(lag: _Observes, interval: float = INTERVAL) -> None:
    """Forever: set a timer ``interval`` ahead and observe how late it ran."""
    loop = asyncio.get_running_loop()
    while True:
        due = loop.time() + interval
        await asyncio.sleep(interval)
        lag.observe(max(0.0, loop.time() - due))
