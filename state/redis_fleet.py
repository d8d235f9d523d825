"""The Redis store's calls for the fleet rather than for conversations: which instances are
draining, whose turn it is to run a periodic job, and whether the server has replicas."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, TypeVar

from carryover.state.channel import Channel
from carryover.state.store import StoreUnavailable

__all__ = ["FleetCalls"]

T = TypeVar("T")


class FleetCalls:
    """Mixed into :class:`~state.redis_store.RedisStore`, which provides these three."""

    _channel: Channel
    _namespace: str

    if TYPE_CHECKING:  # RedisStore's own, with its deadline and error mapping

        async def _call(self, make: Callable[[], Awaitable[T]]) -> T: ...

    def _draining_key(self) -> str:
        return f"{self._namespace}-draining:{{fleet}}"

    async def set_draining(self, instance: str, draining: bool) -> None:
        command = "SADD" if draining else "SREM"
        await self._call(lambda: self._channel.call(command, self._draining_key(), instance))

    async def draining(self) -> set[str]:
        names = await self._call(lambda: self._channel.call("SMEMBERS", self._draining_key()))
        return {name.decode() for name in names}

    async def take_turn(self, name: str, seconds: float, *, now: float) -> bool:
        key = f"{self._namespace}-turn:{{turns}}:{name}"
        millis = max(1, round(seconds * 1000))
        reply = await self._call(
            lambda: self._channel.call("SET", key, repr(now), "NX", "PX", millis)
        )
        return reply is not None

    async def replicas(self) -> int | None:
        """How many replicas the server this URL reaches says are connected to it
        (``INFO replication``); ``None`` when it does not say (a server that renamed or
        forbids ``INFO``)."""
        try:
            info = await self._call(lambda: self._channel.call("INFO", "replication"))
        except StoreUnavailable:
            return None
        text = info.decode() if isinstance(info, bytes) else str(info)
        for line in text.splitlines():
            if line.startswith("connected_slaves:"):
                return int(line.split(":", 1)[1])
        return None
