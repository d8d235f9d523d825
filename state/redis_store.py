"""Redis store: shared by every router replica.

Layout: a record is one string value, ``turn`` as 8 big-endian bytes followed by the msgpack
record, so the commit script can compare turns without decoding msgpack. Claim is ``GETDEL``
(one round trip); commit is one ``EVALSHA``. Epochs are plain counters.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from redis.asyncio import Redis
from redis.backoff import NoBackoff
from redis.exceptions import RedisError
from redis.retry import Retry

from state.keys import ConversationKey
from state.records import Record, RecordDecodeError
from state.store import StoreUnavailable

__all__ = ["RedisStore"]

T = TypeVar("T")

_TURN_BYTES = 8

# KEYS[1] record key; ARGV[1] value (turn header + record); ARGV[2] expiry in ms.
# Byte-wise comparison of the fixed-width big-endian header orders turns numerically.
_COMMIT = """
local current = redis.call('GET', KEYS[1])
if current and string.sub(current, 1, 8) > string.sub(ARGV[1], 1, 8) then
  return 0
end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
return 1
"""


def _encode(record: Record) -> bytes:
    return record.turn.to_bytes(_TURN_BYTES, "big") + record.to_bytes()


def _decode(value: bytes | str | None) -> Record | None:
    if not isinstance(value, bytes):  # the client never decodes responses; None is a miss
        return None
    try:
        return Record.from_bytes(value[_TURN_BYTES:])
    except RecordDecodeError:
        # A record from another version of the format is a miss, not an outage.
        return None


class RedisStore:
    """A :class:`~state.store.Store` on Redis.

    Args:
        client: a ``redis.asyncio.Redis`` (bytes responses).
        timeout: seconds any one call may take before it raises ``StoreUnavailable``.
        namespace: prefix of every key.
        owns_client: close the client in :meth:`close`.
    """

    def __init__(
        self,
        client: Redis,
        *,
        timeout: float = 0.25,
        namespace: str = "carryover",
        owns_client: bool = False,
    ) -> None:
        self._client = client
        self._timeout = timeout
        self._namespace = namespace
        self._owns_client = owns_client
        self._commit = client.register_script(_COMMIT)

    @classmethod
    def from_url(
        cls, url: str, *, timeout: float = 0.25, namespace: str = "carryover", **kwargs: Any
    ) -> RedisStore:
        """A store with its own connection pool: no retries (a failed call is served cold, not
        repeated) and socket timeouts bounded by ``timeout``."""
        client = Redis.from_url(
            url,
            socket_timeout=timeout,
            socket_connect_timeout=timeout,
            retry=Retry(NoBackoff(), 0),
            **kwargs,
        )
        return cls(client, timeout=timeout, namespace=namespace, owns_client=True)

    def _key(self, key: ConversationKey) -> str:
        return key.storage_key(self._namespace)

    def _epoch_key(self, instance: str) -> str:
        return f"{self._namespace}-epoch:{instance}"

    async def _call(self, make: Callable[[], Awaitable[T]]) -> T:
        try:
            async with asyncio.timeout(self._timeout):
                return await make()
        except (RedisError, OSError, TimeoutError) as exc:
            raise StoreUnavailable(f"redis: {type(exc).__name__}: {exc}") from exc

    async def claim(self, key: ConversationKey) -> Record | None:
        value = await self._call(lambda: self._client.getdel(self._key(key)))
        return _decode(value)

    async def commit(self, key: ConversationKey, record: Record, *, now: float) -> bool:
        ttl_ms = int((record.expires_at - now) * 1000)
        if ttl_ms <= 0:
            return False
        written = await self._call(
            lambda: self._commit(keys=[self._key(key)], args=[_encode(record), ttl_ms])
        )
        return bool(written)

    async def get(self, key: ConversationKey) -> Record | None:
        return _decode(await self._call(lambda: self._client.get(self._key(key))))

    async def delete(self, key: ConversationKey) -> Record | None:
        return await self.claim(key)

    async def bump_epoch(self, instance: str) -> int:
        return int(await self._call(lambda: self._client.incr(self._epoch_key(instance))))

    async def epochs(self, instances: list[str]) -> dict[str, int]:
        if not instances:
            return {}
        values = await self._call(
            lambda: self._client.mget([self._epoch_key(name) for name in instances])
        )
        pairs = zip(instances, values, strict=True)
        return {name: int(v) if v is not None else 0 for name, v in pairs}

    async def count(self) -> int:
        async def scan() -> int:
            total = 0
            async for _ in self._client.scan_iter(match=f"{self._namespace}:*", count=1000):
                total += 1
            return total

        try:
            # A scan is many round trips: give it more than one call's timeout.
            async with asyncio.timeout(self._timeout * 40):
                return await scan()
        except (RedisError, OSError, TimeoutError) as exc:
            raise StoreUnavailable(f"redis: {type(exc).__name__}: {exc}") from exc

    async def ping(self) -> None:
        await self._call(lambda: self._client.ping())

    async def close(self) -> None:
        if self._owns_client:
            await self._client.aclose()
