"""The Redis store's reads of its held indexes (``ns-held…:{t}:instance``, see
``state/redis_store.py``): handles held per decode instance, what each tenant holds, and the
claims of pressure relief."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

from carryover.state import redis_scripts as scripts
from carryover.state.channel import Channel
from carryover.state.keys import unescape
from carryover.state.redis_values import decode_value
from carryover.state.relief import largest_holders_first
from carryover.state.resp import Arg, Script
from carryover.state.store import Held, Oldest, TenantUsage

if TYPE_CHECKING:
    from carryover.state.redis_store import _Shard

__all__ = ["HeldIndexCalls"]

T = TypeVar("T")


class HeldIndexCalls:
    """Mixed into :class:`~state.redis_store.RedisStore`, which provides what is declared."""

    _channel: Channel
    _namespace: str
    _shards: list[_Shard]

    if TYPE_CHECKING:  # RedisStore's own

        async def _call(self, make: Callable[[], Awaitable[T]]) -> T: ...

        async def _eval(self, script: Script, keys: Sequence[Arg], args: Sequence[Arg]) -> Any: ...

        async def _record_script(
            self, script: Script, shard: _Shard, keys: Sequence[Arg], args: Sequence[Arg]
        ) -> tuple[Any, bool]: ...

        def _indexes(self, shard: _Shard, instances: Sequence[str]) -> list[Arg]: ...

        def _learn(self, instance: str) -> None: ...

    async def held(self, instances: list[str], *, now: float) -> dict[str, Held]:
        if not instances:
            return {}
        for name in instances:
            self._learn(name)

        async def one(shard: _Shard) -> Any:
            return await self._eval(scripts.HELD, self._indexes(shard, instances), [repr(now)])

        answers = await self._call(lambda: asyncio.gather(*(one(s) for s in self._shards)))
        result: dict[str, Held] = {}
        for i, name in enumerate(instances):
            count = expired = releasable = 0
            oldest: float | None = None
            for answer in answers:
                shard_count, shard_oldest, shard_expired, shard_releasable = answer[
                    4 * i : 4 * i + 4
                ]
                count += int(shard_count)
                expired += int(shard_expired)
                releasable += int(shard_releasable)
                if shard_oldest is not None:
                    created = float(shard_oldest)
                    oldest = created if oldest is None else min(oldest, created)
            result[name] = Held(count, oldest, expired, releasable)
        return result

    async def usage_by_tenant(self, instances: list[str], *, now: float) -> dict[str, TenantUsage]:
        # The held indexes by expiry list every live record's key (keys name tenants), and
        # the tokens hash what D pins for each.
        async def listed(shard: _Shard, instance: str) -> list[tuple[str, int]]:
            held, _, _, tokens = shard.index_keys(self._namespace, instance)
            keys = await self._channel.call("ZRANGEBYSCORE", held, f"({now!r}", "+inf")
            prefix = f"{self._namespace}:{{{shard.tag}}}:".encode()
            found: list[tuple[str, int]] = []
            for start in range(0, len(keys), 1000):
                chunk = keys[start : start + 1000]
                pinned = await self._channel.call("HMGET", tokens, *chunk)
                found += [
                    (_tenant_of(key, prefix), int(n) if n is not None else 0)
                    for key, n in zip(chunk, pinned, strict=True)
                ]
            return found

        for name in instances:
            self._learn(name)
        every = await self._call(
            lambda: asyncio.gather(*(listed(s, i) for s in self._shards for i in instances))
        )
        usage: dict[str, tuple[int, int]] = {}
        for records in every:
            for tenant, pinned in records:
                count, tokens = usage.get(tenant, (0, 0))
                usage[tenant] = (count + 1, tokens + pinned)
        return {tenant: TenantUsage(*found) for tenant, found in usage.items()}

    async def claim_oldest(self, instance: str, count: int, *, now: float) -> Oldest:
        if count <= 0:
            return Oldest([])
        self._learn(instance)

        async def listed(shard: _Shard) -> list[tuple[float, tuple[bytes, _Shard], str]]:
            since = shard.index_keys(self._namespace, instance)[1]
            entries = await self._channel.call("ZRANGE", since, 0, -1, "WITHSCORES")
            prefix = f"{self._namespace}:{{{shard.tag}}}:".encode()
            return [
                (float(entries[j + 1]), (entries[j], shard), _tenant_of(entries[j], prefix))
                for j in range(0, len(entries), 2)
            ]

        withheld = 0

        async def take() -> list[Any]:
            # The largest holders' oldest over every shard (state/relief.py), then one claim
            # per shard they are in. Another
            # replica may claim the same ones first: every entry a round chose is gone from
            # the index after it (claimed, by whoever, or found gone), so rounds end.
            nonlocal withheld
            taken: list[Any] = []
            while True:
                want = count - len(taken)
                every = await asyncio.gather(*(listed(s) for s in self._shards))
                chosen = largest_holders_first((e for entries in every for e in entries), want)
                if not chosen:
                    break
                by_shard: dict[int, tuple[_Shard, list[bytes]]] = {}
                for key, shard in chosen:
                    by_shard.setdefault(id(shard), (shard, []))[1].append(key)
                replies = await asyncio.gather(
                    *(
                        self._record_script(scripts.CLAIM_MANY, shard, keys, [len(keys)])
                        for shard, keys in by_shard.values()
                    )
                )
                # A batch no replica acknowledged is not released (see the module), and the
                # replicas are behind: claiming on would only take more records nobody may
                # release, so this pass ends here.
                taken += [value for reply, durable in replies if durable for value in reply[1]]
                withheld += sum(len(reply[1]) for reply, durable in replies if not durable)
                if withheld or len(taken) >= count:
                    break
            return taken

        values = await self._call(take)
        records = [record for value in values if (record := decode_value(value)) is not None]
        return Oldest(records, withheld)


def _tenant_of(record_key: bytes, prefix: bytes) -> str:
    """The tenant of a record key ``prefix`` + ``tenant:model:id`` (escaped: state/keys.py)."""
    return unescape(record_key[len(prefix) :].split(b":", 1)[0].decode(errors="replace"))
