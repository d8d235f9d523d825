"""Redis store: shared by every router replica, on one server, Sentinel or Cluster.

Layout (``ns`` the namespace, ``{t}`` the hash tag of the conversation's shard, so that a
record, its ended mark and the held indexes it is listed in share one Cluster slot):

* ``ns:{t}:tenant:model:conversation``: one string: ``turn`` as 8 big-endian bytes, the
  holding decode instance's name (2-byte length, then UTF-8), then the msgpack record. The
  scripts compare turns and find the holder without decoding msgpack.
* ``ns-ended:{t}:…``: the mark of a conversation ended by DELETE.
* ``ns-held:{t}:instance`` / ``ns-held-since:{t}:instance``: sorted sets of the shard's
  record keys whose blocks that decode instance holds, scored by expiry and by creation
  time; ``ns-held-expired:{t}:instance`` counts entries found expired unclaimed;
  ``ns-held-tokens:{t}:instance`` is a hash of the tokens D pins for each record. The scripts
  keep them in step with the records, so "handles held per decode instance and their age" is
  one small script per shard, never a scan.
* ``ns-epoch:{epochs}:instance`` (and ``…:identity``): one slot for every epoch, read by one
  ``MGET``.

A conversation's shard is a CRC32 of its key modulo ``shards``: one shard (every key in one
slot) on a single server or Sentinel, where slots mean nothing; 64 on a Cluster, whose tags
(``state/slots.py``) spread evenly over the slot ranges the primaries own. Claim and commit
are one script each, one round trip.

Durability (``docs/redis.md``): with ``Durability.REPLICA`` each write is followed, on the
same connection, by ``WAIT replicas timeout`` (one for all the writes of an event-loop
iteration, on connections only waited writes use: ``state/follow.py``). A claim no replica acknowledged may be undone by
a failover (the replica promoted still has the record), and another router would send the
handle again: such a claim raises :class:`NotDurable` and the caller never sends the handle,
neither to reuse it nor to release it. A commit no replica acknowledged keeps the record but
hands back no replaced record to release, for the same reason.
"""

from __future__ import annotations

import asyncio
import math
import zlib
from collections.abc import Awaitable, Callable, Sequence
from enum import StrEnum
from typing import Any, TypeVar

from carryover.state import redis_scripts as scripts
from carryover.state.channel import Channel
from carryover.state.keys import ConversationKey
from carryover.state.loops import Deadline, RunningLoop
from carryover.state.records import Record
from carryover.state.redis_fleet import FleetCalls
from carryover.state.redis_held import HeldIndexCalls
from carryover.state.redis_values import decode_value, encode_value
from carryover.state.resp import Arg, RespError, Script
from carryover.state.slots import shard_tags
from carryover.state.store import FENCE_SLACK, Committed, Kept, StoreUnavailable

__all__ = ["Durability", "NotDurable", "RedisStore"]

T = TypeVar("T")


class Durability(StrEnum):
    """When a write counts as done."""

    NONE = "none"  #: when the primary answers (one server: there is nothing else)
    REPLICA = "replica"  #: when ``wait_replicas`` replicas acknowledged it (``WAIT``)


class NotDurable(StoreUnavailable):
    """The claim ran, but no replica acknowledged it in time: a failover could bring the
    record back, so its handle must not be sent by this router (it is left to expire)."""


class _Shard:
    """The keys of one shard: its tag, and the held indexes per instance (built once)."""

    __slots__ = ("indexes", "keys", "known", "tag")

    def __init__(self, tag: str) -> None:
        self.tag = tag
        self.indexes: dict[str, tuple[str, str, str, str]] = {}
        self.known: list[str] | None = None  #: the instance list ``keys`` was built for
        self.keys: list[Arg] = []

    def index_keys(self, namespace: str, instance: str) -> tuple[str, str, str, str]:
        """``instance``'s indexes here: held by expiry, by creation, the expired-unclaimed
        count, and the tokens D pins per record."""
        found = self.indexes.get(instance)
        if found is None:
            held = f"{namespace}-held:{{{self.tag}}}:{instance}"
            found = self.indexes[instance] = (
                held,
                f"{namespace}-held-since:{{{self.tag}}}:{instance}",
                f"{namespace}-held-expired:{{{self.tag}}}:{instance}",
                f"{namespace}-held-tokens:{{{self.tag}}}:{instance}",
            )
        return found


class RedisStore(FleetCalls, HeldIndexCalls):
    """A :class:`~state.store.Store` on Redis.

    Args:
        channel: what every call goes over (``state/channel.py``).
        timeout: seconds any one call may take, retries included, before it raises
            ``StoreUnavailable``.
        namespace: prefix of every key (no braces: they would change the keys' slots).
        shards: how many hash tags the conversations are spread over (see the module).
        durability, wait_replicas, wait_timeout: when a write counts as done.
    """

    def __init__(
        self,
        channel: Channel,
        *,
        timeout: float = 0.25,
        namespace: str = "carryover",
        shards: int = 1,
        durability: Durability = Durability.NONE,
        wait_replicas: int = 1,
        wait_timeout: float = 0.05,
        waited: Channel | None = None,
    ) -> None:
        if "{" in namespace or "}" in namespace:
            raise ValueError("a Redis namespace has no braces: they would pick the keys' slots")
        if wait_replicas < 1 or wait_timeout <= 0:
            raise ValueError("wait_replicas must be 1 or more and wait_timeout positive")
        self._channel = channel
        # Waited writes on connections of their own: a WAIT blocks its connection, and no
        # read or unwaited call may queue behind it.
        self._waited = waited or channel
        self._timeout = timeout
        self._namespace = namespace
        self._shards = [_Shard(tag) for tag in shard_tags(shards)]
        self._durable = durability is Durability.REPLICA
        self._wait: list[Arg] = ["WAIT", wait_replicas, max(1, round(wait_timeout * 1000))]
        self._wait_replicas = wait_replicas
        #: decode instances whose held indexes every record script gets (learned as met)
        self._instances: list[str] = []
        self._head: list[Arg] = [0]  #: the scripts' ARGV head: how many instances, their names
        self._running = RunningLoop()

    @classmethod
    def from_url(
        cls,
        url: str,
        *,
        timeout: float = 0.25,
        namespace: str = "carryover",
        **options: Any,
    ) -> RedisStore:
        """A store on the deployment ``url`` names (``state/redis_url.py``); ``options`` are
        :func:`state.redis_url.open_store`'s."""
        from carryover.state.redis_url import open_store

        return open_store(url, timeout=timeout, namespace=namespace, **options)

    # keys

    def _shard(self, key: ConversationKey) -> _Shard:
        shards = self._shards
        if len(shards) == 1:
            return shards[0]
        name = f"{key.tenant}\0{key.model}\0{key.conversation_id}".encode()
        if key.salt:
            name += b"\0" + key.salt.encode()
        return shards[zlib.crc32(name) % len(shards)]

    def _record_key(self, key: ConversationKey, shard: _Shard) -> str:
        return key.storage_key(f"{self._namespace}:{{{shard.tag}}}")

    def _ended_key(self, key: ConversationKey, shard: _Shard) -> str:
        return key.storage_key(f"{self._namespace}-ended:{{{shard.tag}}}")

    def _epoch_key(self, instance: str) -> str:
        return f"{self._namespace}-epoch:{{epochs}}:{instance}"

    def _indexes(self, shard: _Shard, instances: Sequence[str]) -> list[Arg]:
        keys: list[Arg] = []
        for name in instances:
            keys += shard.index_keys(self._namespace, name)
        return keys

    # calls

    async def _call(self, make: Callable[[], Awaitable[T]]) -> T:
        try:
            async with Deadline(self._running(), self._timeout):
                return await make()
        except (RespError, TimeoutError) as exc:
            raise StoreUnavailable(f"redis: {type(exc).__name__}: {exc}") from exc

    async def _eval(self, script: Script, keys: Sequence[Arg], args: Sequence[Arg]) -> Any:
        return (await self._channel.script(script, keys, args))[0]

    async def _record_script(
        self,
        script: Script,
        shard: _Shard,
        keys: Sequence[Arg],
        args: Sequence[Arg],
    ) -> tuple[Any, bool]:
        """Run a script that keeps the held indexes in step; returns its answer (after the
        ``{1, …}`` status) and whether it is durable. A holder the script was not given the
        keys of is learned and the script sent again (it changed nothing)."""
        while True:
            known = self._instances
            if shard.known is not known:  # built once per shard and instance list
                shard.known, shard.keys = known, self._indexes(shard, known)
            durable = self._durable
            reply, acked = await (self._waited if durable else self._channel).script(
                script,
                [*keys, *shard.keys],
                [*self._head, *args],
                after=self._wait if durable else None,
            )
            if reply and reply[0] == b"holder":
                name = reply[1].decode()
                if name in known:  # cannot happen: the script found it missing
                    raise RespError(f"the store's script does not find {name!r}'s indexes")
                self._learn(name)
                continue
            return reply, not durable or (isinstance(acked, int) and acked >= self._wait_replicas)

    def _learn(self, instance: str) -> None:
        if instance not in self._instances:
            self._instances = known = [*self._instances, instance]
            self._head = [len(known), *known]

    # the Store protocol

    @property
    def known(self) -> list[str]:
        """The decode instances whose held indexes every record script carries."""
        return list(self._instances)

    def forget(self, instance: str) -> None:
        # Every record script carries the index keys of each name known: 2,000 departed
        # names made a commit and a claim cost 4.6 ms of Redis CPU instead of 0.13.
        if instance in self._instances:
            self._instances = known = [n for n in self._instances if n != instance]
            self._head = [len(known), *known]

    def kept(self) -> dict[Kept, int]:
        return {Kept.DECODE_NAMES: len(self._instances)}

    async def _on_record(
        self, script: Script, key: ConversationKey, args: Sequence[Arg]
    ) -> tuple[Any, bool]:
        """A record script on ``key``'s record and ended mark, within the call deadline."""
        shard = self._shard(key)
        keys = [self._record_key(key, shard), self._ended_key(key, shard)]
        return await self._call(lambda: self._record_script(script, shard, keys, args))

    async def claim(self, key: ConversationKey) -> Record | None:
        reply, durable = await self._on_record(scripts.CLAIM, key, [])
        record = decode_value(reply[1])
        if record is not None and not durable:
            raise NotDurable("redis: no replica acknowledged the claim in time")
        return record

    async def commit(
        self,
        key: ConversationKey,
        record: Record,
        *,
        now: float,
        running_for: float | None = None,
    ) -> Committed:
        ttl_ms = int((record.expires_at - now) * 1000)
        if ttl_ms <= 0:
            return Committed(written=False)
        self._learn(record.decode)
        reply, durable = await self._on_record(
            scripts.COMMIT,
            key,
            [
                encode_value(record),
                ttl_ms,
                repr(record.expires_at),
                repr(record.created_at),
                repr(now),
                _fence_ms(running_for),
                "0" if record.shadowed else "1",
                record.prefix.length,
            ],
        )
        written, replaced, *ended = reply
        # Not durable: a failover may bring the replaced record back, and with it its
        # handle; releasing it now would free blocks a later claim could still send.
        withheld = not durable and replaced is not None
        return Committed(
            written=bool(written),
            replaced=None if withheld else decode_value(replaced),
            ended=bool(ended and ended[0]),
            withheld=withheld,
        )

    async def get(self, key: ConversationKey) -> Record | None:
        shard = self._shard(key)
        return decode_value(
            await self._call(lambda: self._channel.call("GET", self._record_key(key, shard)))
        )

    async def delete(self, key: ConversationKey, *, fence: float = 0.0) -> Record | None:
        args: list[Arg] = [int(fence * 1000)] if fence > 0 else []
        reply, durable = await self._on_record(scripts.CLAIM, key, args)
        # What was dropped is the caller's to release: only when no failover can undo it.
        return decode_value(reply[1]) if durable else None

    async def observe_identity(self, instance: str, identity: str) -> int:
        keys = [self._epoch_key(instance), f"{self._epoch_key(instance)}:identity"]
        # Not waited on: a bump a failover loses is made again by the next observation,
        # which sees the old identity back (router/fleet/pool.py observes every probe).
        return int(await self._call(lambda: self._eval(scripts.OBSERVE, keys, [identity])))

    async def epochs(self, instances: list[str]) -> dict[str, int]:
        if not instances:
            return {}
        values = await self._call(
            lambda: self._channel.call("MGET", *(self._epoch_key(name) for name in instances))
        )
        pairs = zip(instances, values, strict=True)
        return {name: int(v) if v is not None else 0 for name, v in pairs}

    async def count(self) -> int:
        async def scan(node: Any) -> int:
            total, cursor = 0, b"0"
            while True:
                cursor, keys = await node.call(
                    "SCAN", cursor, "MATCH", f"{self._namespace}:*", "COUNT", 1000
                )
                total += len(keys)
                if cursor == b"0":
                    return total

        try:
            # A scan is many round trips: give it more than one call's timeout.
            async with asyncio.timeout(self._timeout * 40):
                nodes = await self._channel.primaries()
                return sum(await asyncio.gather(*(scan(node) for node in nodes)))
        except (RespError, TimeoutError) as exc:
            raise StoreUnavailable(f"redis: {type(exc).__name__}: {exc}") from exc

    async def ping(self) -> None:
        await self._call(lambda: self._channel.call("PING"))

    @property
    def durability(self) -> Durability:
        return Durability.REPLICA if self._durable else Durability.NONE

    def wait_for_replicas(self) -> None:
        """From now on every write waits for ``wait_replicas`` replicas (``WAIT``)."""
        self._durable = True

    async def close(self) -> None:
        self._channel.close()
        if self._waited is not self._channel:
            self._waited.close()


def _fence_ms(running_for: float | None) -> int | str:
    """How long the turn has run, in whole ms rounded up, with the slack: the script compares
    it with a mark of the server's clock in whole ms ('' : unfenced)."""
    return "" if running_for is None else math.ceil((running_for + FENCE_SLACK) * 1000)
