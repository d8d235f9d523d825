"""One ``WAIT`` for every waited write of an event-loop iteration.

``WAIT`` blocks the connection it is sent on until the replicas acknowledged every write sent
on it before, or its timeout passes. Sent after each write, concurrent writes queue behind
each other's waits: with a lagging replica, 16 concurrent commits took 16 timeouts in a row
and most ran out of their deadline. A ``WAIT`` covers every earlier write of its connection,
so the writes made in one iteration of the event loop share the one written behind them all
at its end: 16 concurrent commits wait once. (The store also keeps waited writes on a
connection of their own, so reads never queue behind a ``WAIT``: ``state/redis_store.py``.)
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import Any, Protocol

__all__ = ["SharedFollow"]


class _Sends(Protocol):
    def send(self, frame: bytes) -> asyncio.Future[Any]: ...


class _Group:
    __slots__ = ("command", "connection", "waiters")

    def __init__(self, connection: _Sends, command: tuple[Any, ...]) -> None:
        self.connection = connection
        self.command = command
        self.waiters: list[asyncio.Future[Any]] = []


class SharedFollow:
    """Hands each waited write a future for the shared command written behind it."""

    def __init__(self, pack: Callable[[Sequence[Any]], bytes]) -> None:
        self._pack = pack
        self._open: _Group | None = None  # written at the end of this iteration

    def after(self, connection: _Sends, command: Sequence[Any]) -> asyncio.Future[Any]:
        """A future for ``command``'s reply, written behind every frame ``connection`` has
        been given so far. Its reply (or the error that kept it from one) is the future's
        value, never raised: a caller that gave up leaves nothing unretrieved."""
        loop = asyncio.get_running_loop()
        mine: asyncio.Future[Any] = loop.create_future()
        group = self._open
        key = tuple(command)
        if group is None or group.connection is not connection or group.command != key:
            group = self._open = _Group(connection, key)
            loop.call_soon(self._write, group)
        group.waiters.append(mine)
        return mine

    def _write(self, group: _Group) -> None:
        if self._open is group:
            self._open = None
        try:
            sent = group.connection.send(self._pack(group.command))
        except Exception as exc:  # the connection closed meanwhile
            _settle(group.waiters, exc)
            return

        def done(future: asyncio.Future[Any]) -> None:
            if future.cancelled():
                _settle(group.waiters, asyncio.CancelledError())
            else:
                error = future.exception()
                _settle(group.waiters, error if error is not None else future.result())

        sent.add_done_callback(done)


def _settle(waiters: list[asyncio.Future[Any]], value: Any) -> None:
    for waiter in waiters:
        if not waiter.done():
            waiter.set_result(value)
