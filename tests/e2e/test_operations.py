"""Operational metrics that span router replicas: handles held per decode instance, their age."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from tests.support.metrics import ascrape
from tests.support.stack import Stack, chat_turn, stack
from tests.support.waiting import eventually

TEXT = "Describe, part {i}, the tides along a long coast and what the moon has to do with them. "


async def held(
    s: Stack, router: int, instance: str, accept: Callable[[tuple[float, float]], bool]
) -> tuple[float, float]:
    """(handles held, oldest age) as one router reports them, once ``accept`` says the
    router's periodic read (--held-interval 0.2) has caught up."""

    async def read() -> tuple[float, float]:
        values = await ascrape(s.client, s.routers[router].url)
        return (
            values.get(f"carryover_decode_handles{{server={instance}}}", -1.0),
            values.get(f"carryover_decode_handle_oldest_age_seconds{{server={instance}}}", -1.0),
        )

    return await eventually(read, accept, what=f"router {router}'s view of {instance}")


async def test_handles_held_per_decode_instance_are_reported_by_every_router(
    tmp_path: Path, redis_server: Any
) -> None:
    flags = ("--redis", redis_server.url, "--held-interval", "0.2")
    async with stack(tmp_path, routers=2, router_flags=flags, sim={"threshold": 16}) as s:
        decode = urlsplit(s.decode[0].url).netloc
        conversations = [f"ops-{uuid.uuid4().hex}" for _ in range(3)]
        histories: dict[str, list[dict[str, Any]]] = {}
        # Ages are checked against moments this test saw (router and test share the clock).
        sent_first = time.time()
        answered_first = 0.0
        for conversation in conversations:
            messages = [{"role": "user", "content": TEXT.format(i=0) * 3}]
            first = await chat_turn(
                s.client, s.routers[0].url, messages, conversation_id=conversation
            )
            assert first.status == 200, first.raw
            answered_first = answered_first or time.time()
            histories[conversation] = [*messages, {"role": "assistant", "content": first.content}]

        # The other router sees the same fleet; the oldest handle is as old as the first turn.
        _, oldest = await held(s, 1, decode, lambda v: v[0] == 3 and v[1] > 0)
        assert 0 < oldest <= time.time() - sent_first

        # The next turn claims one handle (its age is observed) and leaves a new one behind.
        conversation = conversations[0]
        histories[conversation].append({"role": "user", "content": TEXT.format(i=1)})
        sent_second = time.time()
        second = await chat_turn(
            s.client, s.routers[1].url, histories[conversation], conversation_id=conversation
        )
        answered_second = time.time()
        assert second.status == 200 and second.path == "reuse"
        values = await ascrape(s.client, s.routers[1].url)
        assert values["carryover_handle_age_seconds_count"] == 1
        age = values["carryover_handle_age_seconds_sum"]
        assert sent_second - answered_first <= age <= answered_second - sent_first
        assert (await held(s, 0, decode, lambda v: v[0] == 3))[0] == 3

        # Ending conversations frees their handles.
        for conversation in conversations[:2]:
            ended = await s.client.delete(f"{s.routers[0].url}/v1/conversations/{conversation}")
            assert ended.status_code == 200, ended.text
        assert (await held(s, 1, decode, lambda v: v[0] == 1))[0] == 1


async def test_handles_that_expire_unclaimed_are_counted_once_across_routers(
    tmp_path: Path, redis_server: Any
) -> None:
    # Records live 7 - 5 (vLLM's margin) - 1 (queue margin) = 1 s here.
    flags = (
        "--redis",
        redis_server.url,
        "--held-interval",
        "0.2",
        "--decoder-kv-blocks-ttl",
        "7",
        "--queue-margin",
        "1",
    )
    async with stack(tmp_path, routers=2, router_flags=flags, sim={"threshold": 16}) as s:
        decode = urlsplit(s.decode[0].url).netloc
        for i in range(2):
            messages = [{"role": "user", "content": TEXT.format(i=i) * 3}]
            got = await chat_turn(
                s.client, s.routers[i].url, messages, conversation_id=f"gone-{uuid.uuid4().hex}"
            )
            assert got.status == 200, got.raw
        name = f"carryover_decode_handles_expired_unused_total{{server={decode}}}"

        async def counted() -> list[float]:
            return [(await ascrape(s.client, r.url)).get(name, 0.0) for r in s.routers]

        # Each is counted once, by whichever replica's periodic read finds it first.
        await eventually(counted, lambda c: sum(c) >= 2, what="both expiries counted")
        assert sum(await counted()) == 2
        assert (await held(s, 0, decode, lambda v: v[0] == 0))[0] == 0
