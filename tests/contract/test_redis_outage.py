"""Redis going away: calls fail fast with StoreUnavailable and work again after a restart."""

from __future__ import annotations

import time

import pytest

from carryover.bench.redis_server import RedisServer
from carryover.state import ConversationKey, RedisStore, StoreUnavailable
from tests.support.records import make_record

KEY = ConversationKey("acme", "m", "c1")


async def _all_calls_fail(store: RedisStore, bound: float) -> None:
    calls = [
        lambda: store.claim(KEY),
        lambda: store.commit(KEY, make_record(1), now=time.time()),
        lambda: store.get(KEY),
        lambda: store.epochs(["d0"]),
        lambda: store.observe_identity("d0", "started-1"),
        lambda: store.ping(),
    ]
    for call in calls:
        started = time.monotonic()
        with pytest.raises(StoreUnavailable):
            await call()
        # Bounded by the store timeout, not by TCP or a retry loop (a hang never ends; three
        # retries would take four timeouts): the bound leaves a loaded machine room.
        assert time.monotonic() - started < bound


async def test_killed_then_restarted(own_redis: RedisServer) -> None:
    store = RedisStore.from_url(own_redis.url, timeout=0.5)
    try:
        await store.commit(KEY, make_record(1), now=time.time())
        own_redis.kill()
        await _all_calls_fail(store, bound=2.0)
        own_redis.start()  # same port, empty (no persistence)
        assert await store.claim(KEY) is None
        assert (await store.commit(KEY, make_record(2), now=time.time())).written
        got = await store.claim(KEY)
        assert got is not None and got.turn == 2
    finally:
        await store.close()


async def test_frozen_server_times_out(own_redis: RedisServer) -> None:
    store = RedisStore.from_url(own_redis.url, timeout=0.5)
    try:
        await store.ping()
        own_redis.pause()
        await _all_calls_fail(store, bound=2.0)
        own_redis.resume()
        await store.ping()
        assert (await store.commit(KEY, make_record(3), now=time.time())).written
    finally:
        own_redis.resume()
        await store.close()
