"""The warm tier on real vLLM (docs/warm-tier.md): P and D also reach an LMCache server through
vLLM's MultiConnector (NIXL first). A turn whose handle is gone runs ``warm``: P loads the
history's whole chunks from LMCache and computes the rest, by its own counters, and an edited
history loads only the chunks before the edit. LMCache's server going away is tested against
the simulator only (tests/e2e/test_warm_tier.py): on this CPU build a dead server can hang
P's engine step until vLLM's 300 s RPC deadline kills the engine (docs/warm-tier.md).

The router learns what the tier holds from its own P legs: vLLM 0.32's MultiConnector forwards
no KV events of LMCache's connector. Its records live one second here (D's TTL is told as 7 s,
less vLLM's 5 s margin and the 1 s queue margin) while D keeps its pins for an hour, so a
turn finds its record gone without waiting for D; P has no prefix cache of its own, so all it
did not compute came from LMCache.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from carryover.bench.real.launch import VllmPair
from carryover.bench.real.lmcache import CHUNK
from carryover.bench.redis_server import RedisServer
from tests.real.conftest import Engines, routed
from tests.real.helpers import (
    COMPUTED,
    PULLED,
    completion,
    first_prompt,
    salted,
    same_output,
    urls,
)
from tests.support.metrics import OPERATOR_KEY, ascrape
from tests.support.router_proc import RouterProcess
from tests.support.waiting import eventually

pytestmark = [pytest.mark.real, pytest.mark.engines("warm")]

ADMIN = {"Authorization": f"Bearer {OPERATOR_KEY}"}


@pytest.fixture
def warm_pair(engines: Engines) -> VllmPair:
    return engines.pair("warm")


@pytest.fixture
async def warm_router(
    warm_pair: VllmPair, redis_server: RedisServer, tmp_path: Path
) -> AsyncIterator[RouterProcess]:
    assert warm_pair.lmcache is not None
    flags = (
        *("--decoder-kv-blocks-ttl", "7", "--expose-path-header"),
        *("--warm-tier", "lmcache", "--warm-tier-health", warm_pair.lmcache.health),
        *("--warm-tier-chunk-tokens", str(CHUNK)),
        # A warm load took 12 s to 197 s on two loaded cores (docs/warm-tier.md).
        *("--prefill-timeout", "600"),
    )
    async with routed(warm_pair, redis_server, tmp_path, *flags) as router:
        yield router


async def record_gone(client: httpx.AsyncClient, router: RouterProcess, nonce: str) -> None:
    await eventually(
        lambda: client.get(f"{router.url}/admin/conversations/{nonce}", headers=ADMIN),
        lambda r: r.status_code == 404,
        what="the conversation's record expires",
        timeout=60,
    )


async def routed_turn(
    client: httpx.AsyncClient, router: RouterProcess, pair: VllmPair, prompt: list[int], nonce: str
) -> tuple[dict[str, Any], str, float, float]:
    """One turn through the router, checked against D alone (salted); its answer, path, and
    what P loaded and computed for it."""
    p_url, d_url = urls(pair)
    before = await ascrape(client, p_url)
    r = await completion(client, router.url, prompt, conversation=nonce)
    assert r.status_code == 200, r.text
    after = await ascrape(client, p_url)
    want = (await completion(client, d_url, prompt, **salted())).json()
    assert same_output(r.json(), want, chat=False)
    loaded = after.get(PULLED, 0.0) - before.get(PULLED, 0.0)
    computed = after.get(COMPUTED, 0.0) - before.get(COMPUTED, 0.0)
    return r.json(), r.headers["x-carryover-path"], loaded, computed


async def test_a_turn_without_its_handle_loads_its_history_from_lmcache(
    client: httpx.AsyncClient, warm_pair: VllmPair, warm_router: RouterProcess
) -> None:
    p_url, _ = urls(warm_pair)
    nonce = uuid.uuid4().hex[:8]
    prompt = await first_prompt(client, p_url, nonce, 600)
    assert len(prompt) > 2 * CHUNK
    first, path, _, _ = await routed_turn(client, warm_router, warm_pair, prompt, nonce)
    assert path == "cold-miss"

    # The record is gone (as after a long read): P loads the first turn's whole chunks from
    # LMCache, where it saved them, and computes only the rest.
    await record_gone(client, warm_router, nonce)
    second = prompt + first["choices"][0]["token_ids"] + [198] * 40
    _, path, loaded, computed = await routed_turn(client, warm_router, warm_pair, second, nonce)
    assert path == "warm"
    saved = len(prompt) // CHUNK * CHUNK
    assert loaded == saved and computed == len(second) - saved
    router = await ascrape(client, warm_router.url)
    assert router["carryover_warm_tier_turns_total{outcome=hit,tier=lmcache}"] == 1
    assert router["carryover_warm_tier_tokens_total{tier=lmcache}"] == saved

    # An edited history: LMCache keys chunks by their tokens, so P loads only the chunk before
    # the edit and computes the rest; the answer is still the reference's.
    await record_gone(client, warm_router, nonce)
    edited = list(second)
    edited[CHUNK + 10] = 198 if edited[CHUNK + 10] != 198 else 271
    _, path, loaded, computed = await routed_turn(client, warm_router, warm_pair, edited, nonce)
    assert path == "warm" and loaded == CHUNK and computed == len(edited) - CHUNK
