"""Redis store: shared by every router replica.

Layout: a record is one string value: ``turn`` as 8 big-endian bytes, the holding decode
instance's name (2-byte length, then UTF-8), then the msgpack record. The scripts compare turns
and find the holder without decoding msgpack. Claim and commit are one ``EVALSHA`` each.

Each decode instance has two sorted sets of the record keys it holds blocks for, scored by
expiry and by creation time (``{ns}-held:{instance}``, ``{ns}-held-since:{instance}``): the
scripts keep them in step with the records, so "handles held per decode instance and their
age" is a few sorted-set reads, never a scan. Entries left behind by records that expired
unclaimed are counted once and dropped by the next reader. Epochs are plain counters.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TypeVar

from state.keys import ConversationKey
from state.records import Record, RecordDecodeError
from state.resp import Address, RespChannel, RespError, Script
from state.store import Committed, Held, StoreUnavailable

__all__ = ["RedisStore"]

T = TypeVar("T")

_TURN_BYTES = 8
_NAME_LEN_BYTES = 2

# Shared by the scripts. ARGV[1] is always the held-set prefix ("{ns}-held").
_LUA_HELPERS = """
local function holder(value)
  if string.len(value) < 10 then return nil end
  local n = string.byte(value, 9) * 256 + string.byte(value, 10)
  return string.sub(value, 11, 10 + n)
end
local function unhold(value, key)
  local name = holder(value)
  if name then
    redis.call('ZREM', ARGV[1] .. ':' .. name, key)
    redis.call('ZREM', ARGV[1] .. '-since:' .. name, key)
  end
end
"""

# The held sets are addressed from the scripts, not through KEYS: fine on one Redis (or a
# replicated primary), not on Redis Cluster, where the record keys are not co-located anyway.
# KEYS[1] record key, KEYS[2] its ended mark; ARGV[2] value; ARGV[3] lifetime in ms; ARGV[4]
# expires_at; ARGV[5] created_at; ARGV[6] now; ARGV[7] when the turn started ('' : unfenced).
# Byte-wise comparison of the fixed-width big-endian turn orders turns numerically.
_COMMIT = Script(
    _LUA_HELPERS
    + """
if ARGV[7] ~= '' then
  local ended = redis.call('GET', KEYS[2])
  if ended and tonumber(ended) >= tonumber(ARGV[7]) then
    return {0, false, 1}
  end
end
local current = redis.call('GET', KEYS[1])
if current then
  if string.sub(current, 1, 8) > string.sub(ARGV[2], 1, 8) then
    return {0, false}
  end
  unhold(current, KEYS[1])
end
redis.call('SET', KEYS[1], ARGV[2], 'PX', ARGV[3])
local name = holder(ARGV[2])
local by_expiry = ARGV[1] .. ':' .. name
local by_creation = ARGV[1] .. '-since:' .. name
local expired_count = ARGV[1] .. '-expired:' .. name
-- Still listed though its record is gone: it expired unclaimed. Count it before the entry is
-- reused for the new record (an entry in another instance's sets is counted by a reader).
local previous = redis.call('ZSCORE', by_expiry, KEYS[1])
if previous and tonumber(previous) <= tonumber(ARGV[6]) then
  redis.call('INCR', expired_count)
end
redis.call('ZADD', by_expiry, ARGV[4], KEYS[1])
redis.call('ZADD', by_creation, ARGV[5], KEYS[1])
-- A set outlives its newest record by an hour, time for a reader to count what expired
-- unclaimed in it; a set of an instance no longer configured goes away after that.
local lifetime = tonumber(ARGV[3]) + 3600000
for _, set in ipairs({by_expiry, by_creation, expired_count}) do
  if redis.call('PTTL', set) < lifetime then
    redis.call('PEXPIRE', set, lifetime)
  end
end
-- What it replaced: never claimed, so its handle is the caller's to release.
return {1, current}
"""
)

# KEYS[1] record key. Get-and-delete, and the holder forgets it. With KEYS[2] (the ended
# mark), ARGV[2] (now) and ARGV[3] (fence in ms): commits of turns started before now are
# refused while the mark lives.
_CLAIM = Script(
    _LUA_HELPERS
    + """
local value = redis.call('GET', KEYS[1])
if value then
  redis.call('DEL', KEYS[1])
  unhold(value, KEYS[1])
end
if KEYS[2] then
  redis.call('SET', KEYS[2], ARGV[2], 'PX', ARGV[3])
end
return value
"""
)

# ARGV[2] now; KEYS in threes per instance: the held sets by expiry and by creation, and the
# count of entries the commit script found expired. Drops what expired
# (records that expired unclaimed: each is dropped, and so counted, by exactly one reader);
# returns count, oldest creation time and how many were dropped, per instance.
_HELD = Script(
    """
local out = {}
for i = 1, #KEYS, 3 do
  local expired = redis.call('ZRANGEBYSCORE', KEYS[i], '-inf', ARGV[2])
  -- In slices: unpack() of a long list overflows Lua's stack.
  for j = 1, #expired, 1000 do
    redis.call('ZREM', KEYS[i + 1], unpack(expired, j, math.min(j + 999, #expired)))
  end
  redis.call('ZREMRANGEBYSCORE', KEYS[i], '-inf', ARGV[2])
  local oldest = redis.call('ZRANGE', KEYS[i + 1], 0, 0, 'WITHSCORES')
  table.insert(out, redis.call('ZCARD', KEYS[i]))
  table.insert(out, oldest[2] or false)
  table.insert(out, #expired + tonumber(redis.call('GETDEL', KEYS[i + 2]) or '0'))
end
return out
"""
)


# KEYS[1] the held-since set of one instance; ARGV[2] how many. Claims the oldest
# live records that instance holds (each as the claim script does); entries whose record is
# gone or expired are dropped on the way, and expired ones counted as the held script would.
_CLAIM_OLDEST = Script(
    _LUA_HELPERS
    + """
local out = {}
local budget = tonumber(ARGV[2])
local seen = 0
while #out < budget and seen < budget * 4 do
  local entries = redis.call('ZRANGE', KEYS[1], 0, budget - 1)
  if #entries == 0 then break end
  for _, key in ipairs(entries) do
    seen = seen + 1
    local value = redis.call('GET', key)
    if value then
      redis.call('DEL', key)
      unhold(value, key)
      table.insert(out, value)
      if #out >= budget then break end
    else
      -- the record expired unclaimed: leave its expiry entry for the held script to count
      redis.call('ZREM', KEYS[1], key)
    end
  end
end
return out
"""
)


# KEYS[1] epoch counter, KEYS[2] the identity it counts; ARGV[1] the identity observed. One
# bump per new identity, whichever replica reports it first.
_OBSERVE = Script(
    """
local seen = redis.call('GET', KEYS[2])
if seen == ARGV[1] then
  return tonumber(redis.call('GET', KEYS[1]) or '0')
end
redis.call('SET', KEYS[2], ARGV[1])
if not seen then
  return tonumber(redis.call('GET', KEYS[1]) or '0')
end
return redis.call('INCR', KEYS[1])
"""
)


def _encode(record: Record) -> bytes:
    name = record.decode.encode()
    return (
        record.turn.to_bytes(_TURN_BYTES, "big")
        + len(name).to_bytes(_NAME_LEN_BYTES, "big")
        + name
        + record.to_bytes()
    )


def _decode(value: bytes | str | None) -> Record | None:
    if not isinstance(value, bytes):  # the client never decodes responses; None is a miss
        return None
    start = _TURN_BYTES + _NAME_LEN_BYTES
    start += int.from_bytes(value[_TURN_BYTES:start], "big")
    try:
        return Record.from_bytes(value[start:])
    except RecordDecodeError:
        # A record from another version of the format is a miss, not an outage.
        return None


class RedisStore:
    """A :class:`~state.store.Store` on Redis.

    Args:
        channel: the connection every call goes over (one pipelined socket per event loop).
        timeout: seconds any one call may take before it raises ``StoreUnavailable``.
        namespace: prefix of every key.
    """

    def __init__(
        self, channel: RespChannel, *, timeout: float = 0.25, namespace: str = "carryover"
    ) -> None:
        self._channel = channel
        self._timeout = timeout
        self._namespace = namespace

    @classmethod
    def from_url(
        cls, url: str, *, timeout: float = 0.25, namespace: str = "carryover"
    ) -> RedisStore:
        """A store on the server at ``url`` (``redis://``, ``rediss://`` or ``unix://``).

        No call is retried: a failed call is served cold, not repeated. A connection that
        answers nothing for four call timeouts while calls wait is dropped and remade.
        """
        channel = RespChannel(
            Address.from_url(url), connect_timeout=timeout, dead_after=max(1.0, 4 * timeout)
        )
        return cls(channel, timeout=timeout, namespace=namespace)

    def _key(self, key: ConversationKey) -> str:
        return key.storage_key(self._namespace)

    @property
    def _held_prefix(self) -> str:
        return f"{self._namespace}-held"

    def _held_since_key(self, instance: str) -> str:
        """The instance's held records scored by creation time (oldest first)."""
        return f"{self._held_prefix}-since:{instance}"

    def _ended_key(self, key: ConversationKey) -> str:
        """The mark of a conversation ended by DELETE (outside the records' key space)."""
        return key.storage_key(f"{self._namespace}-ended")

    def _epoch_key(self, instance: str) -> str:
        return f"{self._namespace}-epoch:{instance}"

    async def _call(self, make: Callable[[], Awaitable[T]]) -> T:
        try:
            async with asyncio.timeout(self._timeout):
                return await make()
        except (RespError, TimeoutError) as exc:
            raise StoreUnavailable(f"redis: {type(exc).__name__}: {exc}") from exc

    async def claim(self, key: ConversationKey) -> Record | None:
        value = await self._call(
            lambda: self._channel.evalsha(_CLAIM, [self._key(key)], [self._held_prefix])
        )
        return _decode(value)

    async def commit(
        self,
        key: ConversationKey,
        record: Record,
        *,
        now: float,
        started_at: float | None = None,
    ) -> Committed:
        ttl_ms = int((record.expires_at - now) * 1000)
        if ttl_ms <= 0:
            return Committed(written=False)
        answer = await self._call(
            lambda: self._channel.evalsha(
                _COMMIT,
                [self._key(key), self._ended_key(key)],
                [
                    self._held_prefix,
                    _encode(record),
                    ttl_ms,
                    repr(record.expires_at),
                    repr(record.created_at),
                    repr(now),
                    repr(started_at) if started_at is not None else "",
                ],
            )
        )
        written, replaced, *ended = answer
        return Committed(
            written=bool(written), replaced=_decode(replaced), ended=bool(ended and ended[0])
        )

    async def get(self, key: ConversationKey) -> Record | None:
        return _decode(await self._call(lambda: self._channel.call("GET", self._key(key))))

    async def delete(
        self, key: ConversationKey, *, now: float | None = None, fence: float = 0.0
    ) -> Record | None:
        if now is None or fence <= 0:
            return await self.claim(key)
        value = await self._call(
            lambda: self._channel.evalsha(
                _CLAIM,
                [self._key(key), self._ended_key(key)],
                [self._held_prefix, repr(now), int(fence * 1000)],
            )
        )
        return _decode(value)

    async def observe_identity(self, instance: str, identity: str) -> int:
        keys = [self._epoch_key(instance), f"{self._epoch_key(instance)}:identity"]
        return int(await self._call(lambda: self._channel.evalsha(_OBSERVE, keys, [identity])))

    async def epochs(self, instances: list[str]) -> dict[str, int]:
        if not instances:
            return {}
        values = await self._call(
            lambda: self._channel.call("MGET", *(self._epoch_key(name) for name in instances))
        )
        pairs = zip(instances, values, strict=True)
        return {name: int(v) if v is not None else 0 for name, v in pairs}

    async def count(self) -> int:
        async def scan() -> int:
            total, cursor = 0, b"0"
            while True:
                cursor, keys = await self._channel.call(
                    "SCAN", cursor, "MATCH", f"{self._namespace}:*", "COUNT", 1000
                )
                total += len(keys)
                if cursor == b"0":
                    return total

        try:
            # A scan is many round trips: give it more than one call's timeout.
            async with asyncio.timeout(self._timeout * 40):
                return await scan()
        except (RespError, TimeoutError) as exc:
            raise StoreUnavailable(f"redis: {type(exc).__name__}: {exc}") from exc

    async def held(self, instances: list[str], *, now: float) -> dict[str, Held]:
        if not instances:
            return {}
        keys: list[str] = []
        for name in instances:
            keys += [
                f"{self._held_prefix}:{name}",
                self._held_since_key(name),
                f"{self._held_prefix}-expired:{name}",
            ]
        answer = await self._call(
            lambda: self._channel.evalsha(_HELD, keys, [self._held_prefix, repr(now)])
        )
        result: dict[str, Held] = {}
        for i, name in enumerate(instances):
            count, oldest, expired = answer[3 * i : 3 * i + 3]
            result[name] = Held(int(count), float(oldest) if oldest else None, int(expired))
        return result

    async def claim_oldest(self, instance: str, count: int, *, now: float) -> list[Record]:
        if count <= 0:
            return []
        values = await self._call(
            lambda: self._channel.evalsha(
                _CLAIM_OLDEST,
                [self._held_since_key(instance)],
                [self._held_prefix, count],
            )
        )
        return [record for value in values if (record := _decode(value)) is not None]

    async def ping(self) -> None:
        await self._call(lambda: self._channel.call("PING"))

    async def close(self) -> None:
        self._channel.close()
