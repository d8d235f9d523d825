"""Instance bookkeeping (in-flight counts, breaker trials) ends right on every exit path."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import httpx

from tests.support.metrics import ascrape
from tests.support.stack import Stack, stack
from tests.support.waiting import eventually

TEXT = "Tell me slowly about the lighthouse keeper and the long winter nights on the rock. "


async def in_flight(s: Stack, url: str) -> float:
    name = url.removeprefix("http://")
    metrics = await ascrape(s.client, s.router.url)
    # Every configured instance has its series from the router's start (router/fleet/pool.py): a
    # missing one is a fault of the count, not a zero.
    return metrics[f"carryover_instance_in_flight{{server={name}}}"]


def stream_body(content: str, max_tokens: int) -> dict[str, Any]:
    return {
        "model": "sim-qwen3",
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": True,
    }


async def leave_after(s: Stack, body: dict[str, Any], events: int) -> None:
    """Stream a chat turn and hang up once ``events`` SSE events arrived."""
    async with (
        httpx.AsyncClient(timeout=30) as client,
        client.stream("POST", s.router.url + "/v1/chat/completions", json=body) as r,
    ):
        assert r.status_code == 200
        seen = 0
        async for line in r.aiter_lines():
            seen += line.startswith("data: ")
            if seen >= events:
                return


async def test_a_client_leaving_mid_stream_leaves_nothing_in_flight(tmp_path: Path) -> None:
    # Real-time decode steps: a 300-token answer streams for about two seconds.
    async with stack(tmp_path, sim={"speed": 1.0}) as s:
        body = stream_body(TEXT, 300) | {"conversation_id": "leaving"}
        await leave_after(s, body, 1)  # the first chunk is in: leave
        d = s.decode[0].url
        await eventually(lambda: in_flight(s, d), lambda n: n == 0, what="D's in-flight count")
        await eventually(
            lambda: ascrape(s.client, s.router.url),
            lambda m: m["carryover_in_flight"] == 0,
            what="the router's in-flight count",
        )


async def test_a_client_leaving_mid_stream_stops_the_relay_at_once(tmp_path: Path) -> None:
    # Slowed decode steps: the whole answer would take about 28 s. Only a relay that is
    # cancelled when the client leaves (not one that reads D to the end and drops what it
    # sends) frees D's lease within the few seconds waited here.
    async with stack(tmp_path, sim={"speed": 4.0}) as s:
        await leave_after(s, stream_body(TEXT, 1000), 3)  # past the relay's first chunk
        d = s.decode[0].url
        await eventually(
            lambda: in_flight(s, d), lambda n: n == 0, what="D's lease freed", timeout=8
        )


async def test_many_clients_leaving_at_random_points_leave_nothing_in_flight(
    tmp_path: Path,
) -> None:
    async with stack(tmp_path, sim={"speed": 1.0}) as s:
        await asyncio.gather(
            *(leave_after(s, stream_body(f"{i}: {TEXT}", 200), 1 + 7 * i) for i in range(8))
        )
        for url in (s.decode[0].url, s.prefill[0].url):
            await eventually(lambda u=url: in_flight(s, u), lambda n: n == 0, what=url)
