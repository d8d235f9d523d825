"""Every handle D returns ends stored, sent once, or released: none is kept that describes
other tokens than D holds, and none is dropped while D keeps its blocks pinned."""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path
from typing import Any

import httpx
import pytest

from carryover.bench.redis_server import RedisServer
from tests.support.metrics import ascrape
from tests.support.stack import chat_turn, first_turn, held_by, reference_chat, stack
from tests.support.waiting import eventually

TEXT = "Turn {i}: a walk along the old canal, the locks, the barges and the lock keepers. "


async def test_decode_that_ran_other_ids_leaves_no_record(tmp_path: Path) -> None:
    async with stack(tmp_path, sim={"threshold": 16}) as s:
        await s.client.post(s.decode[0].url + "/sim/faults", json={"alter_prompt": True})
        conversation = uuid.uuid4().hex
        messages: list[dict[str, Any]] = [{"role": "user", "content": TEXT.format(i=1) * 3}]
        first = await chat_turn(s.client, s.router.url, messages, conversation_id=conversation)
        assert first.status == 200, first.raw
        await s.client.post(s.decode[0].url + "/sim/faults", json={"alter_prompt": False})
        # D's blocks hold other tokens than the router checked: released, not stored.
        await eventually(lambda: held_by(s), lambda h: h == [], what="D's pin is released")
        router = await ascrape(s.client, s.router.url)
        assert router["carryover_handles_released_total{cause=decode_prompt_mismatch}"] == 1
        messages += [
            {"role": "assistant", "content": first.content},
            {"role": "user", "content": TEXT.format(i=2)},
        ]
        second = await chat_turn(s.client, s.router.url, messages, conversation_id=conversation)
        assert second.path == "cold-miss"
        assert second.content == (await reference_chat(s, messages)).content


@pytest.mark.parametrize("backend", ["memory", "redis"])
async def test_overlapping_turns_leave_one_pinned_handle(
    tmp_path: Path, redis_server: RedisServer, backend: str
) -> None:
    # Four requests of one conversation at once (a client retrying, an agent loop): each
    # commits a record of the same turn over the last. Every overwritten handle was never
    # sent, so the router releases it; D keeps the blocks of the one stored record only.
    flags = ("--redis", redis_server.url) if backend == "redis" else ()
    async with stack(tmp_path, router_flags=flags, sim={"threshold": 16}) as s:
        conversation = uuid.uuid4().hex
        messages: list[dict[str, Any]] = [{"role": "user", "content": TEXT.format(i=1) * 3}]
        # All four are held at D until each has claimed (nothing yet) and passed P: then
        # their commits overlap, whatever the machine's speed.
        await s.client.post(s.decode[0].url + "/sim/faults", json={"hang": True})
        turns = [
            asyncio.create_task(
                chat_turn(s.client, s.router.url, messages, conversation_id=conversation)
            )
            for _ in range(4)
        ]
        await eventually(
            lambda: ascrape(s.client, s.prefill[0].url),
            lambda m: m.get("vllm:request_success_total:sum", 0) == 4,
            what="four P legs",
        )
        await s.client.post(s.decode[0].url + "/sim/faults", json={"hang": False})
        answers = await asyncio.gather(*turns)
        assert all(a.status == 200 for a in answers), [a.raw for a in answers]
        await eventually(lambda: held_by(s), lambda h: len(h) == 1, what="one pinned handle")
        router = await ascrape(s.client, s.router.url)
        assert router["carryover_handles_released_total{cause=replaced}"] == 3
        # The stored one is still good.
        messages += [
            {"role": "assistant", "content": answers[0].content},
            {"role": "user", "content": TEXT.format(i=2)},
        ]
        nxt = await chat_turn(s.client, s.router.url, messages, conversation_id=conversation)
        assert nxt.path == "reuse"
        assert nxt.content == (await reference_chat(s, messages)).content


async def test_a_decode_restart_is_one_epoch_for_every_router(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    flags = ("--redis", redis_server.url)
    async with stack(tmp_path, routers=2, router_flags=flags, sim={"threshold": 16}) as s:
        decode = s.decode[0].url.removeprefix("http://")
        conversation = uuid.uuid4().hex
        messages: list[dict[str, Any]] = [{"role": "user", "content": TEXT.format(i=1) * 3}]
        first = await chat_turn(s.client, s.routers[0].url, messages, conversation_id=conversation)
        assert first.path == "cold-miss", first.raw
        await s.client.post(s.decode[0].url + "/sim/faults", json={"restart": True})
        restarts = f"carryover_instance_restarts_total{{role=decode,server={decode}}}"
        for router in s.routers:
            await eventually(
                lambda r=router: ascrape(s.client, r.url),
                lambda m: m.get(restarts, 0) >= 1,
                what=f"{router.url} notices D's restart",
            )
        answer = first.content
        paths = []
        for turn in range(2, 6):  # alternating routers
            messages += [
                {"role": "assistant", "content": answer},
                {"role": "user", "content": TEXT.format(i=turn)},
            ]
            got = await chat_turn(
                s.client, s.routers[turn % 2].url, messages, conversation_id=conversation
            )
            assert got.content == (await reference_chat(s, messages)).content
            paths.append(got.path)
            answer = got.content
        # The stale handle is never sent (no P 500); every record written since is good on
        # both routers.
        assert paths == ["cold-expired", "reuse", "reuse", "reuse"]
        p_metrics = await ascrape(s.client, s.prefill[0].url)
        assert p_metrics["vllm:nixl_num_failed_transfers_total"] == 0


async def test_a_prefill_4xx_after_the_handle_was_sent_releases_it(tmp_path: Path) -> None:
    async with stack(tmp_path, sim={"threshold": 16}) as s:
        conversation, messages = await first_turn(s, TEXT.format(i=1) * 3, TEXT.format(i=2))
        # A field only the engine validates: P refuses the request that carries the handle.
        refused = await chat_turn(
            s.client, s.router.url, messages, conversation_id=conversation, stop=5
        )
        assert refused.status == 400, refused.raw
        await eventually(lambda: held_by(s), lambda h: h == [], what="D's pin is released")
        router = await ascrape(s.client, s.router.url)
        assert router["carryover_handles_released_total{cause=prefill_refused}"] == 1


async def test_a_client_leaving_while_p_holds_the_handle_is_counted(tmp_path: Path) -> None:
    async with stack(tmp_path, sim={"threshold": 16}) as s:
        conversation, messages = await first_turn(s, TEXT.format(i=1) * 3, TEXT.format(i=2))
        await s.client.post(s.prefill[0].url + "/sim/faults", json={"hang": True})
        body = {"model": "sim-qwen3", "messages": messages, "conversation_id": conversation}
        with pytest.raises(httpx.ReadTimeout):
            await s.client.post(s.router.url + "/v1/chat/completions", json=body, timeout=1.0)
        name = "carryover_handles_left_to_expire_total{cause=sent_then_cancelled}"
        await eventually(
            lambda: ascrape(s.client, s.router.url),
            lambda m: m.get(name, 0) == 1,
            what="the handle P held is counted, not released",
        )
        assert "carryover_handles_released_total{cause=client_gone}" not in (
            await ascrape(s.client, s.router.url)
        )
        await s.client.post(s.prefill[0].url + "/sim/faults", json={"hang": False})


async def test_delete_during_a_turn_leaves_no_record_and_no_pin(tmp_path: Path) -> None:
    async with stack(tmp_path, sim={"threshold": 16}) as s:
        conversation, messages = await first_turn(s, TEXT.format(i=1) * 3, TEXT.format(i=2))
        # Turn 2 is held at D while the client ends the conversation.
        await s.client.post(s.decode[0].url + "/sim/faults", json={"hang": True})
        second = asyncio.create_task(
            chat_turn(s.client, s.router.url, messages, conversation_id=conversation)
        )
        await eventually(
            lambda: ascrape(s.client, s.prefill[0].url),
            lambda m: m.get("vllm:request_success_total:sum", 0) >= 2,
            what="turn 2's P leg",
        )
        ended = await s.client.delete(f"{s.router.url}/v1/conversations/{conversation}")
        assert ended.json()["deleted"] is False  # turn 2 holds what there was
        await s.client.post(s.decode[0].url + "/sim/faults", json={"hang": False})
        assert (await second).status == 200
        # Its commit is refused and its handle released: nothing is left of the conversation.
        await eventually(lambda: held_by(s), lambda h: h == [], what="no pin left at D")
        router = await ascrape(s.client, s.router.url)
        assert router["carryover_handles_released_total{cause=conversation_ended}"] == 1
        messages += [
            {"role": "assistant", "content": (await second).content},
            {"role": "user", "content": TEXT.format(i=3)},
        ]
        third = await chat_turn(s.client, s.router.url, messages, conversation_id=conversation)
        assert third.path == "cold-miss"
