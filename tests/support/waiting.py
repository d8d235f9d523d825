"""Waiting on a condition with a deadline: how tests synchronize (never a bare sleep).

A deadline here is a failure bound, not a measurement: it is generous, so that a slow or
loaded machine only makes a test take longer, and its message says what never happened.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

T = TypeVar("T")

#: Long enough for anything a simulated engine or a router does on a loaded 2-core machine.
DEFAULT_TIMEOUT = 60.0


class ConditionTimeout(AssertionError):
    """The condition did not hold before the deadline."""


async def eventually(
    probe: Callable[[], Awaitable[T]],
    accept: Callable[[T], bool] = bool,
    *,
    what: str,
    timeout: float = DEFAULT_TIMEOUT,
    interval: float = 0.05,
) -> T:
    """Call ``probe`` until ``accept`` says yes to what it returned; return that value."""
    deadline = time.monotonic() + timeout
    last: T | None = None
    while True:
        last = await probe()
        if accept(last):
            return last
        if time.monotonic() >= deadline:
            raise ConditionTimeout(f"{what}: not within {timeout:g} s (last seen: {last!r})")
        await asyncio.sleep(interval)


def eventually_sync(
    probe: Callable[[], T],
    accept: Callable[[T], bool] = bool,
    *,
    what: str,
    timeout: float = DEFAULT_TIMEOUT,
    interval: float = 0.1,
) -> T:
    """The blocking twin of :func:`eventually`, for code that runs outside an event loop."""
    deadline = time.monotonic() + timeout
    while True:
        last = probe()
        if accept(last):
            return last
        if time.monotonic() >= deadline:
            raise ConditionTimeout(f"{what}: not within {timeout:g} s (last seen: {last!r})")
        time.sleep(interval)
