"""Store calls whose outcome is unknown: a handle is released only when it is provably not
stored and never will be (a frozen redis-server, the simulator's single-use handles)."""

from __future__ import annotations

import asyncio
from pathlib import Path

from carryover.bench.redis_server import RedisServer
from tests.support.metrics import ascrape
from tests.support.stack import chat_turn, completion_turn, first_turn, reference_chat, stack
from tests.support.waiting import eventually

TEXT = "Turn {i}: the tide tables of a long northern coast, read aloud slowly and in full. "
READ_AFTER_RELEASE = "vllm:nixl_num_notifications_after_expiry_total"


async def test_a_commit_that_times_out_is_not_followed_by_a_release(
    tmp_path: Path, own_redis: RedisServer
) -> None:
    # Turn 2's commit is sent to a frozen Redis and times out in the router; Redis runs it
    # when it thaws, so the record lands. Had the router released the handle (D frees the
    # blocks), turn 3 would claim that record and make P read freed blocks.
    # Nothing else of the router's may be waiting on the frozen server when the commit is
    # sent: a health loop's epoch read stuck there holds the pool's idle connection, and the
    # commit would then open a new one whose handshake never ends, so it would never be sent
    # at all (seen once in a full run). Probes and handle reads wait for the test's end.
    flags = ("--redis", own_redis.url, "--store-timeout", "0.5")
    flags += ("--health-interval", "3600", "--held-interval", "3600")
    sim = {"threshold": 16}
    p_sim = {"enable_prefix_caching": False}  # every pull is from D, nothing from P's cache
    d_sim = {"num_blocks": 96}  # small: other work soon overwrites a freed block
    async with stack(tmp_path, router_flags=flags, sim=sim, p_sim=p_sim, d_sim=d_sim) as s:
        p, d = s.prefill[0], s.decode[0]
        conversation, messages = await first_turn(s, TEXT.format(i=1) * 3, TEXT.format(i=2) * 3)

        async def p_requests() -> float:
            return (await ascrape(s.client, p.url)).get("vllm:request_success_total:sum", 0.0)

        done_before = await p_requests()
        await s.client.post(d.url + "/sim/faults", json={"hang": True})
        second_task = asyncio.create_task(
            chat_turn(s.client, s.router.url, messages, conversation_id=conversation)
        )
        # P answered turn 2's P leg, so its claim is done; D holds the turn until Redis is
        # frozen, then the commit meets the frozen server.
        await eventually(p_requests, lambda n: n > done_before, what="turn 2's P leg")
        own_redis.pause()
        try:
            await s.client.post(d.url + "/sim/faults", json={"hang": False})
            second = await second_task
        finally:
            own_redis.resume()
        assert second.status == 200 and second.path == "reuse", second.raw
        # Other work takes every free block of D. Blocks a release had freed would be among
        # them, and turn 3 would read this request's KV in place of its history.
        state = (await s.client.get(d.url + "/sim/state")).json()
        free = state["num_blocks"] - state["used_blocks"]
        filler = await completion_turn(
            s.client, s.router.url, [100] * (free * 16 - 1), max_tokens=1, ignore_eos=True
        )
        assert filler.status == 200, filler.raw
        messages += [
            {"role": "assistant", "content": second.content},
            {"role": "user", "content": TEXT.format(i=3)},
        ]
        third = await chat_turn(s.client, s.router.url, messages, conversation_id=conversation)
        assert third.status == 200, third.raw
        assert third.path == "reuse"  # the commit landed after all
        assert third.content == (await reference_chat(s, messages)).content
        assert (await ascrape(s.client, d.url)).get(READ_AFTER_RELEASE, 0.0) == 0
        router = await ascrape(s.client, s.router.url)
        assert router["carryover_store_errors_total{op=commit}"] >= 1
        assert router["carryover_handles_left_to_expire_total{cause=commit_outcome_unknown}"] == 1
        assert "carryover_handles_released_total{cause=store_unavailable}" not in router


async def test_a_claim_that_times_out_is_counted_and_served_cold(
    tmp_path: Path, own_redis: RedisServer
) -> None:
    flags = ("--redis", own_redis.url, "--store-timeout", "0.5")
    async with stack(tmp_path, router_flags=flags, sim={"threshold": 16}) as s:
        conversation, messages = await first_turn(s, TEXT.format(i=1) * 3, TEXT.format(i=2))
        own_redis.pause()
        try:
            second = await chat_turn(s.client, s.router.url, messages, conversation_id=conversation)
        finally:
            own_redis.resume()
        assert second.status == 200 and second.path == "cold-error", second.raw
        assert second.content == (await reference_chat(s, messages)).content
        router = await ascrape(s.client, s.router.url)
        assert router["carryover_handles_left_to_expire_total{cause=claim_outcome_unknown}"] == 1
