"""Work a turn starts that must run to its end whatever happens to the request."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

__all__ = ["Background"]

T = TypeVar("T")


class Background:
    """The tasks that outlive their request: claims, commits, releases, render warm-ups.
    Shutdown waits for them (:meth:`drain`)."""

    __slots__ = ("tasks",)

    def __init__(self) -> None:
        self.tasks: set[asyncio.Task[Any]] = set()

    def run(self, work: Coroutine[Any, Any, T]) -> asyncio.Task[T]:
        """Run ``work`` to its end: a client that leaves cancels the request, never this. A
        caller that needs the result awaits ``asyncio.shield`` of the task: what ``work``
        decides about a handle then happens even if the caller is cancelled meanwhile."""
        task = asyncio.create_task(work)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        return task

    async def drain(self) -> None:
        if self.tasks:
            await asyncio.gather(*self.tasks, return_exceptions=True)
