"""Restarting the pair makes stored records stale and empties the index.

The pair comes back as the next configuration of the tier (``warm``), on the same ports: to
the router both engines are the instances it knew, restarted with new engine ids, which is
all this test is about; the tier saves a start of the engines.
"""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path
from typing import Any

import httpx
import pytest

from carryover.bench.real.launch import VllmPair
from carryover.bench.redis_server import RedisServer
from tests.real.conftest import Engines, routed
from tests.real.helpers import chat, same_output, text, urls
from tests.support.metrics import ascrape
from tests.support.waiting import eventually

pytestmark = [pytest.mark.real, pytest.mark.engines("restart")]


async def test_decode_restart_makes_records_stale(
    client: httpx.AsyncClient,
    engines: Engines,
    vllm_pair: VllmPair,
    redis_server: RedisServer,
    tmp_path: Path,
) -> None:
    # It restarts the pair (P and D together, as this machine needs) on the same ports. D comes
    # back with a new engine id; the router sees the restart and bumps D's epoch, so the stored
    # handle is stale: the next turn is cold without ever sending it (a sent stale handle would
    # show as a P 500 and the path "cold-error"). The record outlives the minute-long restart
    # (D_TTL).
    async with routed(vllm_pair, redis_server, tmp_path) as router:
        nonce = uuid.uuid4().hex[:8]
        messages: list[dict[str, Any]] = [{"role": "user", "content": text(nonce, 0, 300)}]
        r1 = await chat(client, router.url, messages, conversation=nonce)
        assert r1.status_code == 200
        p_url, d_url = urls(vllm_pair)
        d_name = d_url.removeprefix("http://")
        # The index holds what D kept of every turn of this tier (its pins last an hour).
        blocks = f"carryover_kv_index_blocks{{server={d_name}}}"
        held = await eventually(
            lambda: ascrape(client, router.url),
            lambda m: m.get(blocks, 0) >= 1,
            what="the new router's index replayed D's blocks",
            timeout=120,
        )
        restarted = await asyncio.to_thread(engines.restart_as, "warm")
        assert urls(restarted) == (p_url, d_url)
        restarts = f"carryover_instance_restarts_total{{role=decode,server={d_name}}}"
        resets = f"carryover_kv_index_resets_total{{cause=restart,server={d_name}}}"
        await eventually(
            lambda: ascrape(client, router.url),
            lambda m: m.get(restarts, 0) >= 1 and m.get(resets, 0) >= 1,
            what="the router notices D's restart and drops its index entries",
            timeout=120,
        )
        # The new D holds at most the warm-up's blocks, far fewer than the old one's pins.
        assert (await ascrape(client, router.url)).get(blocks, 0) < held[blocks]
        messages += [
            {"role": "assistant", "content": r1.json()["choices"][0]["message"]["content"]},
            {"role": "user", "content": text(nonce, 1, 30)},
        ]
        r2 = await chat(client, router.url, messages, conversation=nonce)
        assert r2.status_code == 200 and r2.headers["x-carryover-path"] == "cold-expired"
        assert same_output(r2.json(), (await chat(client, p_url, messages)).json(), chat=True)
        assert "prefill_handle_rejected" not in (await client.get(router.url + "/metrics")).text
