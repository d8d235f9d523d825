"""The pipelined Redis channel against real servers: order, abandoned calls, scripts the
server forgot, credentials and databases from the URL, a server that stops answering."""

from __future__ import annotations

import asyncio
import time

import pytest
import redis

from carryover.bench.redis_server import RedisServer
from carryover.state import ConversationKey, RedisStore, StoreUnavailable
from carryover.state.resp import Address, ReplyError, RespChannel, RespConnectionError, Script
from tests.support.records import make_record

KEY = ConversationKey("acme", "m", "c1")


async def test_concurrent_calls_get_their_own_replies(redis_server: RedisServer) -> None:
    channel = RespChannel(Address.from_url(redis_server.url))
    try:
        words = [f"word-{i}".encode() * (i % 7 + 1) for i in range(500)]
        echoed = await asyncio.gather(*(channel.call("ECHO", w) for w in words))
        assert echoed == words
    finally:
        channel.close()


async def test_an_abandoned_call_does_not_shift_the_replies_behind_it(
    own_redis: RedisServer,
) -> None:
    channel = RespChannel(Address.from_url(own_redis.url), dead_after=30)
    try:
        assert await channel.call("PING") == b"PONG"
        own_redis.pause()
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.2):
                await channel.call("ECHO", "given up")
        later = asyncio.ensure_future(channel.call("ECHO", "mine"))
        own_redis.resume()
        assert await asyncio.wait_for(later, 10) == b"mine"
    finally:
        own_redis.resume()
        channel.close()


async def test_a_silent_connection_is_dropped_and_remade(own_redis: RedisServer) -> None:
    channel = RespChannel(Address.from_url(own_redis.url), dead_after=0.3)
    try:
        await channel.call("SET", "k", "v")
        before = await channel.call("CLIENT", "ID")
        own_redis.pause()
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.5):
                await channel.call("GET", "k")
        # Still frozen: the next call finds the connection silent past dead_after and opens
        # another (the kernel accepts it), where it waits in turn.
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.5):
                await channel.call("PING")
        own_redis.resume()
        assert await asyncio.wait_for(channel.call("GET", "k"), 10) == b"v"
        assert await channel.call("CLIENT", "ID") != before
    finally:
        own_redis.resume()
        channel.close()


async def test_a_reply_error_fails_only_its_call(redis_server: RedisServer) -> None:
    channel = RespChannel(Address.from_url(redis_server.url))
    try:
        results = await asyncio.gather(
            channel.call("ECHO", "a"),
            channel.call("NOT-A-COMMAND"),
            channel.call("ECHO", "b"),
            return_exceptions=True,
        )
        assert results[0] == b"a" and results[2] == b"b"
        assert isinstance(results[1], ReplyError)
    finally:
        channel.close()


async def test_a_script_the_server_forgot_is_sent_again(redis_server: RedisServer) -> None:
    channel = RespChannel(Address.from_url(redis_server.url))
    script = Script("return ARGV[1] .. KEYS[1]")
    try:
        assert await channel.evalsha(script, ["k"], ["x"]) == b"xk"
        redis.Redis(port=redis_server.port).script_flush()
        assert await channel.evalsha(script, ["k"], ["y"]) == b"yk"
        # ... and is cached again by that call
        assert redis.Redis(port=redis_server.port).script_exists(script.sha) == [True]
    finally:
        channel.close()


async def test_a_store_survives_a_script_flush(redis_server: RedisServer) -> None:
    store = RedisStore.from_url(redis_server.url, namespace="flush", timeout=5)
    try:
        await store.commit(KEY, make_record(4), now=time.time())
        redis.Redis(port=redis_server.port).script_flush()
        got = await store.claim(KEY)
        assert got is not None and got.turn == 4
    finally:
        await store.close()


async def test_credentials_and_database_come_from_the_url(own_redis: RedisServer) -> None:
    admin = redis.Redis(port=own_redis.port)
    admin.acl_setuser("carry", enabled=True, passwords=["+s3cret"], keys=["*"], commands=["+@all"])
    admin.config_set("requirepass", "other")  # the default user needs a password now
    url = f"redis://carry:s3cret@127.0.0.1:{own_redis.port}/3"
    store = RedisStore.from_url(url, namespace="db3", timeout=5)
    anonymous = RedisStore.from_url(own_redis.url, namespace="db3", timeout=5)
    try:
        await store.commit(KEY, make_record(2), now=time.time())
        authed = redis.Redis(port=own_redis.port, username="carry", password="s3cret", db=3)
        assert authed.dbsize() >= 1
        with pytest.raises(StoreUnavailable, match=r"NOAUTH|Authentication"):
            await anonymous.get(KEY)
        assert "s3cret" not in repr(Address.from_url(url))
    finally:
        await store.close()
        await anonymous.close()


async def test_wrong_password_is_a_clear_error_without_the_password(
    own_redis: RedisServer,
) -> None:
    redis.Redis(port=own_redis.port).config_set("requirepass", "right")
    channel = RespChannel(Address.from_url(f"redis://:wrong-pw@127.0.0.1:{own_redis.port}/0"))
    try:
        with pytest.raises(ReplyError) as caught:
            await channel.call("PING")
        assert "wrong-pw" not in str(caught.value)
    finally:
        channel.close()


async def test_a_refused_connect_fails_fast(own_redis: RedisServer) -> None:
    # A connect timeout far beyond any loaded machine's delay: a refusal must not wait for it.
    channel = RespChannel(Address.from_url(own_redis.url), connect_timeout=60)
    own_redis.kill()
    started = time.monotonic()
    with pytest.raises(RespConnectionError):
        await channel.call("PING")
    assert time.monotonic() - started < 30  # refused at once, not the connect timeout
    channel.close()


async def test_callers_waiting_on_an_abandoned_connect_get_a_connection_error(
    own_redis: RedisServer,
) -> None:
    # The first caller's deadline cancels the connect it started; the others waiting on it
    # must see a connection error, not a cancellation of their own.
    own_redis.pause()  # the kernel still accepts; the SELECT of the setup is never answered
    channel = RespChannel(Address.from_url(f"redis://127.0.0.1:{own_redis.port}/1"))
    try:

        async def first() -> None:
            async with asyncio.timeout(0.2):
                await channel.call("PING")

        async def second() -> None:  # runs once the first one's connect is under way
            await channel.call("PING")

        results = await asyncio.gather(first(), second(), return_exceptions=True)
        assert isinstance(results[0], TimeoutError)
        assert isinstance(results[1], RespConnectionError)
    finally:
        own_redis.resume()
        channel.close()
