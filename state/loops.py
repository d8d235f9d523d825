"""The running event loop and a deadline over a block of awaits, without system calls.

On Python 3.11 every ``asyncio.get_running_loop()`` is a ``getpid()`` system call (the check
that tells a forked child from its parent), and ``asyncio.timeout`` looks the loop up twice
and the task once. A Redis store call runs twice a turn: eight system calls a turn that
tell the store what it already knew (``bench/RESULTS.md``, router overhead).
"""

from __future__ import annotations

import asyncio
import os
import threading
from types import TracebackType

__all__ = ["Deadline", "RunningLoop"]

_forks = 0


def _forked() -> None:
    global _forks
    _forks += 1


os.register_at_fork(after_in_child=_forked)


class RunningLoop:
    """``asyncio.get_running_loop()``, remembered.

    The loop found last is the running one while it runs in the calling thread (a thread
    runs one loop at a time) and the process has not forked since; anything else asks
    asyncio again. Call it from a coroutine or a callback, as ``get_running_loop``."""

    __slots__ = ("_forks", "_loop", "_thread")

    def __init__(self) -> None:
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread = 0
        self._forks = -1

    def __call__(self) -> asyncio.AbstractEventLoop:
        loop = self._loop
        if (
            loop is not None
            and self._forks == _forks
            and self._thread == threading.get_ident()
            and loop.is_running()
        ):
            return loop
        loop = self._loop = asyncio.get_running_loop()
        self._thread = threading.get_ident()
        self._forks = _forks
        return loop


class Deadline:
    """``asyncio.timeout(delay)`` on a loop the caller holds: the block's task is cancelled
    after ``delay`` seconds and the cancellation leaves the block as ``TimeoutError``; a
    cancellation from elsewhere passes through as it is."""

    __slots__ = ("_cancelling", "_delay", "_expired", "_handle", "_loop", "_task")

    def __init__(self, loop: asyncio.AbstractEventLoop, delay: float) -> None:
        self._loop = loop
        self._delay = delay
        self._expired = False

    async def __aenter__(self) -> Deadline:
        task = asyncio.current_task(self._loop)  # given the loop: no lookup
        if task is None:
            raise RuntimeError("a deadline needs a task")
        self._task = task
        self._cancelling = task.cancelling()
        self._handle = self._loop.call_later(self._delay, self._expire)
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self._handle.cancel()
        # As asyncio.Timeout: the cancel it made is taken back; only a cancellation nobody
        # else asked for becomes the timeout.
        if (
            self._expired
            and self._task.uncancel() <= self._cancelling
            and exc_type is asyncio.CancelledError
        ):
            raise TimeoutError from exc

    def _expire(self) -> None:
        self._expired = True
        self._task.cancel()
