"""The Redis store's Lua scripts. Every key a script touches is in its ``KEYS``, and all of
them share one hash tag (a shard's, or the epochs'), so each runs on one Cluster slot.

The scripts that write or drop a record keep the held indexes of the decode instance holding
its blocks in step. They get the indexes of every instance the caller knows in ``KEYS``, in
fours (held by expiry, held by creation, expired-unclaimed count, pinned tokens by record)
after the record's two keys, with the instances' names in ``ARGV[2..n+1]`` (``ARGV[1]`` = n). A record whose holder
is not among them is not touched: the script answers ``{'holder', name}`` and the caller
sends it again with that instance's keys (it learns the name once).
"""

from __future__ import annotations

from carryover.state.resp import Script

__all__ = ["CLAIM", "CLAIM_MANY", "COMMIT", "HELD", "OBSERVE"]

# Record values: an 8-byte big-endian turn, the holder's name (2-byte length, UTF-8), then
# the msgpack record. ``base`` is the index of ARGV's first script-specific argument.
_HELPERS = """
local n = tonumber(ARGV[1])
local base = n + 2
-- This server's clock in ms: fences compare times of one clock, whatever the callers' say.
local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
local function holder(value)
  if string.len(value) < 10 then return nil end
  local size = string.byte(value, 9) * 256 + string.byte(value, 10)
  return string.sub(value, 11, 10 + size)
end
-- KEYS index of the holder's first index key; nil when the caller did not pass it.
local function indexes(name, first)
  for i = 1, n do
    if ARGV[i + 1] == name then return first + 4 * (i - 1) end
  end
  return nil
end
local function unhold(at, key)
  redis.call('ZREM', KEYS[at], key)
  redis.call('ZREM', KEYS[at + 1], key)
  redis.call('HDEL', KEYS[at + 3], key)
end
"""

# KEYS[1] record, KEYS[2] its ended mark, then the index fours. ARGV[base] value,
# ARGV[base+1] lifetime in ms, +2 expires_at, +3 created_at, +4 now, +5 how long the turn has
# run, in ms ('' : unfenced; its start is placed on this server's clock, as the ended mark is), +6 '1' when pressure relief may take it (listed by creation time), '0' for
# a shadowed record (Record.shadowed: counted as held, never chosen by relief), +7 the tokens
# D pins for it. Byte-wise comparison of the fixed-width big-endian turns orders them.
COMMIT = Script(
    _HELPERS
    + """
local value = ARGV[base]
if ARGV[base + 5] ~= '' then
  local ended = redis.call('GET', KEYS[2])
  if ended and tonumber(ended) >= now_ms() - tonumber(ARGV[base + 5]) then
    return {0, false, 1}
  end
end
local current = redis.call('GET', KEYS[1])
local name = holder(value)
local at = indexes(name, 3)
if not at then return {'holder', name} end
local old_at = nil
if current then
  if string.sub(current, 1, 8) > string.sub(value, 1, 8) then
    return {0, false}
  end
  local old = holder(current)
  if old then
    old_at = indexes(old, 3)
    if not old_at then return {'holder', old} end
  end
end
if old_at then unhold(old_at, KEYS[1]) end
redis.call('SET', KEYS[1], value, 'PX', ARGV[base + 1])
-- Still listed though its record is gone: it expired unclaimed. Count it before the entry is
-- reused for the new record (an entry in another instance's sets is counted by a reader).
local previous = redis.call('ZSCORE', KEYS[at], KEYS[1])
if previous and tonumber(previous) <= tonumber(ARGV[base + 4]) then
  redis.call('INCR', KEYS[at + 2])
end
redis.call('ZADD', KEYS[at], ARGV[base + 2], KEYS[1])
redis.call('HSET', KEYS[at + 3], KEYS[1], ARGV[base + 7])
if ARGV[base + 6] == '1' then
  redis.call('ZADD', KEYS[at + 1], ARGV[base + 3], KEYS[1])
else
  redis.call('ZREM', KEYS[at + 1], KEYS[1])
end
-- An index outlives its newest record by an hour, time for a reader to count what expired
-- unclaimed in it; one of an instance no longer configured goes away after that.
local lifetime = tonumber(ARGV[base + 1]) + 3600000
for i = at, at + 3 do
  if redis.call('PTTL', KEYS[i]) < lifetime then
    redis.call('PEXPIRE', KEYS[i], lifetime)
  end
end
-- What it replaced: never claimed, so its handle is the caller's to release.
return {1, current}
"""
)

# KEYS[1] record, KEYS[2] its ended mark, then the index fours. Get-and-delete, and the
# holder forgets it. With ARGV[base] (a fence in ms), commits of turns started before now (this
# server's clock) are refused while the ended mark lives.
CLAIM = Script(
    _HELPERS
    + """
local value = redis.call('GET', KEYS[1])
if value then
  local name = holder(value)
  local at = name and indexes(name, 3)
  if name and not at then return {'holder', name} end
  redis.call('DEL', KEYS[1])
  if at then unhold(at, KEYS[1]) end
end
if ARGV[base] then
  redis.call('SET', KEYS[2], string.format('%d', now_ms()), 'PX', ARGV[base])
end
return {1, value}
"""
)

# KEYS[1..m] records of one shard (m = ARGV[base]), then the index fours. Claims each as
# CLAIM does; a record that is gone (claimed meanwhile, or expired unclaimed) leaves its
# expiry entry for HELD to count, and its creation and tokens entries are dropped.
CLAIM_MANY = Script(
    _HELPERS
    + """
local m = tonumber(ARGV[base])
local out = {}
for k = 1, m do
  local value = redis.call('GET', KEYS[k])
  if value then
    local name = holder(value)
    local at = name and indexes(name, m + 1)
    if name and not at then return {'holder', name} end
    redis.call('DEL', KEYS[k])
    if at then unhold(at, KEYS[k]) end
    table.insert(out, value)
  else
    for i = 1, n do
      redis.call('ZREM', KEYS[m + 4 * (i - 1) + 2], KEYS[k])
      redis.call('HDEL', KEYS[m + 4 * (i - 1) + 4], KEYS[k])
    end
  end
end
return {1, out}
"""
)

# The index fours of one shard; ARGV[1] now. Drops what expired (records that expired
# unclaimed: each is dropped, and so counted, by exactly one reader); returns the count, the
# oldest creation time of those relief may take, how many were dropped, and how many relief
# may take (not shadowed), per instance.
HELD = Script(
    """
local out = {}
for i = 1, #KEYS, 4 do
  local expired = redis.call('ZRANGEBYSCORE', KEYS[i], '-inf', ARGV[1])
  -- In slices: unpack() of a long list overflows Lua's stack.
  for j = 1, #expired, 1000 do
    local slice = {unpack(expired, j, math.min(j + 999, #expired))}
    redis.call('ZREM', KEYS[i + 1], unpack(slice))
    redis.call('HDEL', KEYS[i + 3], unpack(slice))
  end
  redis.call('ZREMRANGEBYSCORE', KEYS[i], '-inf', ARGV[1])
  local oldest = redis.call('ZRANGE', KEYS[i + 1], 0, 0, 'WITHSCORES')
  table.insert(out, redis.call('ZCARD', KEYS[i]))
  table.insert(out, oldest[2] or false)
  table.insert(out, #expired + tonumber(redis.call('GETDEL', KEYS[i + 2]) or '0'))
  table.insert(out, redis.call('ZCARD', KEYS[i + 1]))
end
return out
"""
)

# KEYS[1] epoch counter, KEYS[2] the identity it counts; ARGV[1] the identity observed. One
# bump per new identity, whichever replica reports it first.
OBSERVE = Script(
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
