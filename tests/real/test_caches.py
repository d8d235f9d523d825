"""Routing by where the KV is, on real vLLM: the index fed by both engines' events against
their own prefix-cache counters.

P keeps a prefix cache here: a turn without a handle finds its history there, and
``/reset_prefix_cache`` (dev mode) clears it.
"""

from __future__ import annotations

import uuid
from pathlib import Path

import httpx
import pytest

from carryover.bench.real.launch import VllmPair
from carryover.bench.redis_server import RedisServer
from tests.real.conftest import routed
from tests.real.helpers import (
    BLOCK,
    COMPUTED,
    HITS,
    INDEX_BLOCKS,
    PULLED,
    SERVED_NAME,
    completion,
    first_prompt,
    reset_prefix_cache,
    salted,
    same_output,
    text,
    tokenize,
    urls,
)
from tests.support.metrics import ascrape
from tests.support.router_proc import RouterProcess
from tests.support.secrets import register
from tests.support.waiting import eventually

pytestmark = [pytest.mark.real, pytest.mark.engines("pd")]

SAID = "carryover_kv_cached_tokens_total{{leg={leg}}}"


def name(url: str) -> str:
    return url.removeprefix("http://")


async def first_turn(
    client: httpx.AsyncClient, router: RouterProcess, pair: VllmPair, nonce: str, words: int = 300
) -> tuple[list[int], list[int]]:
    """A conversation's first turn through ``router``, once the index holds what both engines
    kept of it: its prompt and D's output."""
    p_url, d_url = urls(pair)
    prompt = await first_prompt(client, p_url, nonce, words)
    before = await ascrape(client, router.url)
    r = await completion(client, router.url, prompt, conversation=nonce)
    assert r.status_code == 200 and r.headers["x-carryover-path"] == "cold-miss", r.text
    output: list[int] = r.json()["choices"][0]["token_ids"]
    held = {
        name(p_url): len(prompt) // BLOCK,
        name(d_url): (len(prompt) + len(output) - 1) // BLOCK,
    }
    await eventually(
        lambda: ascrape(client, router.url),
        lambda m: all(
            m.get(INDEX_BLOCKS.format(name=n), 0)
            >= before.get(INDEX_BLOCKS.format(name=n), 0) + blocks
            for n, blocks in held.items()
        ),
        what="the index holds both engines' blocks of the first turn",
        timeout=120,
    )
    return prompt, output


async def next_prompt(
    client: httpx.AsyncClient, p_url: str, prompt: list[int], output: list[int], nonce: str
) -> list[int]:
    suffix = (
        f"<|im_end|>\n<|im_start|>user\n{text(nonce, 1, 40)}<|im_end|>\n<|im_start|>assistant\n"
    )
    return prompt + output + await tokenize(client, p_url, prompt=suffix)


async def test_the_kv_index_follows_vllms_own_events(
    client: httpx.AsyncClient, vllm_pair: VllmPair, real_router: RouterProcess
) -> None:
    """The router's index, fed by D's KV events, says D holds what D's own prefix-cache
    counter then shows it did not compute (docs/kv-events.md)."""
    p_url, d_url = urls(vllm_pair)
    d_name = name(d_url)
    nonce = uuid.uuid4().hex[:8]
    prompt, output = await first_turn(client, real_router, vllm_pair, nonce)
    history = len(prompt) + len(output) - 1  # what D ran and keeps
    router = await ascrape(client, real_router.url)
    for why in ("undecodable", "unknown_event"):
        assert router.get(f"carryover_kv_events_skipped_total{{server={d_name},why={why}}}", 0) == 0
    second = await next_prompt(client, p_url, prompt, output, nonce)
    said = "carryover_kv_cached_tokens_total{leg=decode}"
    said_before = router.get(said, 0.0)
    hits_before = (await ascrape(client, d_url)).get(HITS, 0.0)
    r = await completion(client, real_router.url, second, conversation=nonce)
    assert r.status_code == 200, r.text
    said_delta = (await ascrape(client, real_router.url)).get(said, 0.0) - said_before
    hits_delta = (await ascrape(client, d_url)).get(HITS, 0.0) - hits_before
    assert said_delta >= history // BLOCK * BLOCK
    # vLLM leaves at least the prompt's last token to compute.
    assert hits_delta == min(said_delta, (len(second) - 1) // BLOCK * BLOCK)


# Before any test that releases a handle: a release is a one-token request through P, whose
# block P keeps for D's read until its lease ends (D never reads it), and vLLM refuses a
# reset while P holds a block.
async def test_reset_prefix_cache_empties_the_index_of_p(
    client: httpx.AsyncClient, vllm_pair: VllmPair, real_router: RouterProcess
) -> None:
    """vLLM's AllBlocksCleared after /reset_prefix_cache: the index forgets what P held. vLLM
    publishes the event with its next engine step's output (``Scheduler.update_from_output``),
    so an idle P's reset reaches the index with the next request, ahead of that request's own
    blocks: afterwards the index holds exactly those."""
    p_url, _ = urls(vllm_pair)
    nonce = uuid.uuid4().hex[:8]
    prompt, _ = await first_turn(client, real_router, vllm_pair, nonce, words=120)
    blocks = INDEX_BLOCKS.format(name=name(p_url))
    held = (await ascrape(client, real_router.url))[blocks]

    await reset_prefix_cache(client, p_url)
    p_before = await ascrape(client, p_url)
    r = await completion(client, real_router.url, prompt, conversation=uuid.uuid4().hex[:8])
    assert r.status_code == 200, r.text
    p_after = await ascrape(client, p_url)
    assert p_after[HITS] == p_before[HITS]  # P's cache was empty indeed
    mine = len(prompt) // BLOCK
    assert held > mine  # the index held more than this prompt's blocks before the reset
    await eventually(
        lambda: ascrape(client, real_router.url),
        lambda m: m.get(blocks) == mine,
        what="the index holds only the blocks P stored after AllBlocksCleared",
        timeout=60,
    )


async def test_without_a_handle_p_computes_only_what_its_cache_lacks(
    client: httpx.AsyncClient, vllm_pair: VllmPair, real_router: RouterProcess
) -> None:
    """The handle is gone (deleted here, as D's TTL would end it): the next turn is cold, and
    the index sends it to the P that still holds the history's blocks. P's own counters show
    those blocks served from its cache, nothing pulled, only the rest computed."""
    p_url, _ = urls(vllm_pair)
    nonce = uuid.uuid4().hex[:8]
    prompt, output = await first_turn(client, real_router, vllm_pair, nonce)
    deleted = await client.delete(f"{real_router.url}/v1/conversations/{nonce}")
    assert deleted.json()["released"] is True
    second = await next_prompt(client, p_url, prompt, output, nonce)
    p_before, r_before = await ascrape(client, p_url), await ascrape(client, real_router.url)
    r = await completion(client, real_router.url, second, conversation=nonce)
    assert r.status_code == 200 and r.headers["x-carryover-path"] == "cold-miss", r.text
    p_after, r_after = await ascrape(client, p_url), await ascrape(client, real_router.url)

    def delta(after: dict[str, float], before: dict[str, float], key: str) -> float:
        return after.get(key, 0.0) - before.get(key, 0.0)

    hits = delta(p_after, p_before, HITS)
    assert hits == len(prompt) // BLOCK * BLOCK  # the first turn's whole blocks
    assert delta(p_after, p_before, PULLED) == 0
    assert delta(p_after, p_before, COMPUTED) == len(second) - hits
    assert delta(r_after, r_before, SAID.format(leg="prefill")) == hits  # the index said so
    # The client is told what no engine computed for this turn: P's hits.
    assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == hits
    want = (await completion(client, p_url, second, **salted())).json()
    assert same_output(r.json(), want, chat=False)


async def test_a_decode_local_turn_is_served_from_ds_own_cache(
    client: httpx.AsyncClient, vllm_pair: VllmPair, redis_server: RedisServer, tmp_path: Path
) -> None:
    """A short next turn on the D that holds its history runs there alone: D's prefix-cache
    counter rises by the history's blocks, P runs nothing of it, the answer is the
    reference's, and the unneeded handle is released."""
    p_url, d_url = urls(vllm_pair)
    # No price on D's running streams: the count the router reads varies with timing (it sent
    # this turn through P in two of three CI runs), and this test is about serving the turn
    # from D's cache (the pricing: tests/unit/test_turn_costs.py).
    flags = ("--decode-local-max-tokens", "512", "--cost-decode-stall", "0")
    joined = f"carryover_kv_event_replays_total{{outcome=recovered,server={name(d_url)}}}"
    async with routed(vllm_pair, redis_server, tmp_path, *flags) as router:
        # The turn runs decode-local only once the router's index, fed by D's events, says D
        # holds the history: a fresh router first loads what D held (its join replay), then
        # D's events of the first turn arrive on their own schedule (first_turn waits).
        await eventually(
            lambda: ascrape(client, router.url),
            lambda m: m.get(joined, 0) >= 1,
            what="the router loaded D's earlier blocks",
        )
        nonce = uuid.uuid4().hex[:8]
        prompt, output = await first_turn(client, router, vllm_pair, nonce)
        second = await next_prompt(client, p_url, prompt, output, nonce)
        p_before, d_before = await ascrape(client, p_url), await ascrape(client, d_url)
        r = await completion(client, router.url, second, conversation=nonce)
        assert r.status_code == 200 and r.headers["x-carryover-path"] == "decode-local", r.text
        d_after = await ascrape(client, d_url)
        history = (len(prompt) + len(output) - 1) // BLOCK * BLOCK
        hits = d_after[HITS] - d_before[HITS]
        assert hits == min(history, (len(second) - 1) // BLOCK * BLOCK)
        assert d_after[PULLED] == d_before[PULLED]  # nothing came from P
        assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == hits
        released = "carryover_handles_released_total{cause=decode_local}"
        await eventually(
            lambda: ascrape(client, router.url),
            lambda m: m.get(released, 0) >= 1,
            what="the unneeded handle released",
        )
        # P saw the release (one token, nothing pulled), not the turn.
        p_after = await ascrape(client, p_url)
        tokens = "vllm:prompt_tokens_by_source_total:sum"
        assert p_after[tokens] - p_before[tokens] <= 1
        assert p_after[PULLED] == p_before[PULLED]
        want = (await completion(client, p_url, second, **salted())).json()
        assert same_output(r.json(), want, chat=False)


async def test_a_second_tenants_identical_prompt_computes_every_token(
    client: httpx.AsyncClient, vllm_pair: VllmPair, redis_server: RedisServer, tmp_path: Path
) -> None:
    """vLLM honours the salt the router gives each tenant: tenant B's prompt, token for token
    tenant A's, finds nothing of A's in P's prefix cache and computes every token (P's own
    counters); A sending it again finds its blocks."""
    keys = tmp_path / "keys.json"
    keys.write_text('{"sk-tenant-a-5e1d": "a", "sk-tenant-b-93c0": "b"}')
    register("sk-tenant-a-5e1d", "sk-tenant-b-93c0")
    p_url, _ = urls(vllm_pair)
    nonce = uuid.uuid4().hex[:8]
    prompt = await first_prompt(client, p_url, nonce, 300)
    env = {"CARRYOVER_API_KEYS_FILE": str(keys)}
    async with routed(vllm_pair, redis_server, tmp_path, env=env) as router:

        async def send(key: str) -> dict[str, float]:
            before = await ascrape(client, p_url)
            r = await client.post(
                router.url + "/v1/completions",
                json={"model": SERVED_NAME, "prompt": prompt, "max_tokens": 2, "temperature": 0},
                headers={"Authorization": f"Bearer {key}"},
            )
            assert r.status_code == 200, r.text
            after = await ascrape(client, p_url)
            return {k: after.get(k, 0.0) - before.get(k, 0.0) for k in (HITS, COMPUTED)}

        await send("sk-tenant-a-5e1d")
        b = await send("sk-tenant-b-93c0")
        # No token of B's came from a cache. (P may compute a token more meanwhile: an earlier
        # test's handle release is a one-token request through P, sent in the background.)
        assert b[HITS] == 0 and b[COMPUTED] >= len(prompt)
        a = await send("sk-tenant-a-5e1d")
        assert a[HITS] == len(prompt) // BLOCK * BLOCK
