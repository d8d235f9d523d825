"""A handle's end on real vLLM: released, deleted, expired, and served by D alone while P is
drained.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

import httpx
import msgspec
import pytest

from carryover.bench.real.launch import VllmPair
from carryover.bench.redis_server import RedisServer
from carryover.router.engines.gauges import KV_CAPACITY_TOKENS, parse_gauges
from carryover.router.http.auth import DEFAULT_TENANT
from carryover.state import ConversationKey, RedisStore
from tests.real.conftest import D_TTL
from tests.real.helpers import (
    BLOCK,
    SERVED_NAME,
    chat,
    completion,
    first_prompt,
    pulled,
    salted,
    same_output,
    text,
    tokenize,
    urls,
)
from tests.support.metrics import OPERATOR_KEY, ascrape
from tests.support.router_proc import RouterProcess
from tests.support.waiting import eventually

pytestmark = [pytest.mark.real, pytest.mark.engines("pd")]


async def test_release_and_delete_free_decode_blocks_at_once(
    client: httpx.AsyncClient, vllm_pair: VllmPair, real_router: RouterProcess
) -> None:
    _, d_url = urls(vllm_pair)
    usage = "vllm:kv_cache_usage_perc"
    # Earlier tests' pins live for the session: D's usage is measured against what it was
    # before this test (tests run one at a time), in blocks.
    u0 = (await ascrape(client, d_url))[usage]
    nonce = uuid.uuid4().hex[:8]
    r1 = await chat(
        client,
        real_router.url,
        [{"role": "user", "content": text(nonce, 0, 300)}],
        conversation=nonce,
    )
    assert r1.status_code == 200
    u1 = (await ascrape(client, d_url))[usage]
    blocks1 = -(
        -(len(r1.json()["prompt_token_ids"]) + len(r1.json()["choices"][0]["token_ids"]) - 1)
        // BLOCK
    )
    total_blocks = round(blocks1 / (u1 - u0))  # D pins exactly the turn's blocks
    # The cache's size the router reads from vLLM's /metrics (the pin rule's capacity) is the
    # one D's usage gauge is a fraction of (vLLM derives kv_cache_size_tokens from its
    # concurrency at max_model_len: within a few percent).
    metrics = (await client.get(d_url + "/metrics")).text
    capacity = parse_gauges(metrics)[KV_CAPACITY_TOKENS]
    assert capacity == pytest.approx(total_blocks * BLOCK, rel=0.05)
    # The same conversation id with an unrelated history: nothing is reusable, so the old
    # handle goes to P with remote_num_tokens 0 and D frees it while this turn runs.
    other = [{"role": "user", "content": "x " + text(nonce + "b", 0, 30)}]
    r2 = await chat(client, real_router.url, other, conversation=nonce)
    assert r2.headers["x-carryover-path"] == "cold-mismatch"
    blocks2 = -(
        -(len(r2.json()["prompt_token_ids"]) + len(r2.json()["choices"][0]["token_ids"]) - 1)
        // BLOCK
    )

    async def held() -> int:
        return round(((await ascrape(client, d_url))[usage] - u0) * total_blocks)

    # vLLM updates the usage gauge at its next scheduler step, which on two busy cores can
    # come after the answer: read until it settles, far inside D's hour-long TTL.
    await eventually(held, lambda n: n == blocks2, what="turn 1's blocks are freed", timeout=30)
    deleted = await client.delete(f"{real_router.url}/v1/conversations/{nonce}")
    assert deleted.json() == {"id": nonce, "deleted": True, "released": True}
    # At once, not after the TTL.
    await eventually(held, lambda n: n == 0, what="the deleted turn's blocks", timeout=30)


async def test_prefill_unavailable_decode_serves_alone_and_reuse_continues(
    client: httpx.AsyncClient, vllm_pair: VllmPair, real_router: RouterProcess
) -> None:
    # "P down" as the router sees it: drained (restarting a real P alone while D runs hangs its
    # start on this machine, so the pair is never split).
    p_url, _ = urls(vllm_pair)
    nonce = uuid.uuid4().hex[:8]
    admin = {"Authorization": f"Bearer {OPERATOR_KEY}"}
    p_name = p_url.removeprefix("http://")
    messages: list[dict[str, Any]] = [{"role": "user", "content": text(nonce, 0, 300)}]
    drained = await client.post(f"{real_router.url}/admin/instances/{p_name}/drain", headers=admin)
    assert drained.json()["draining"] is True
    try:
        r1 = await chat(client, real_router.url, messages, conversation=nonce)
        assert r1.status_code == 200
        want = (await chat(client, p_url, messages, **salted())).json()
        assert same_output(r1.json(), want, chat=True)
    finally:
        await client.post(f"{real_router.url}/admin/instances/{p_name}/drain?undo=1", headers=admin)
    completion_ids = r1.json()["choices"][0]["token_ids"]
    prompt = r1.json()["prompt_token_ids"] + completion_ids
    before = await pulled(client, p_url)
    suffix = await tokenize(
        client,
        p_url,
        prompt=f"<|im_end|>\n<|im_start|>user\n{text(nonce, 1, 40)}<|im_end|>\n<|im_start|>assistant\n",
    )
    # Turn 1 ran on D alone: P holds nothing of it and pulls all that the handle covers.
    r2 = await completion(client, real_router.url, prompt + suffix, conversation=nonce)
    # The completions turn continues the same conversation id only within its own model/tenant
    # key: the chat record is found and reused because the ids extend it exactly.
    assert r2.headers["x-carryover-path"] == "reuse"
    assert await pulled(client, p_url) - before == len(prompt) - 1
    assert same_output(
        r2.json(),
        (await completion(client, p_url, prompt + suffix, **salted())).json(),
        chat=False,
    )


async def test_expired_handles_are_served_cold(
    client: httpx.AsyncClient,
    vllm_pair: VllmPair,
    redis_server: RedisServer,
    real_router: RouterProcess,
) -> None:
    # Time is moved, not waited for: the stored handle's deadline (D's clock, which P compares
    # with its own through the handshake's offset) is set back by D's TTL, as if D kept blocks
    # for no time at all. P then declines the read as it declines any expired one (HTTP 500,
    # "Declining expired remote read") and the router retries the turn cold. D's own expiry
    # is tested with the simulator, whose clock can jump.
    p_url, _ = urls(vllm_pair)
    nonce = uuid.uuid4().hex[:8]
    prompt = await first_prompt(client, p_url, nonce, 300)
    prompt2_tail = [198] * 20
    rejected = "carryover_retries_total{cause=prefill_handle_rejected}"
    rejected_before = (await ascrape(client, real_router.url)).get(rejected, 0)
    first = (await completion(client, real_router.url, prompt, conversation=nonce)).json()
    prompt2 = prompt + first["choices"][0]["token_ids"] + prompt2_tail
    want = (await completion(client, p_url, prompt2, **salted())).json()
    key = ConversationKey(DEFAULT_TENANT, SERVED_NAME, nonce)
    store = RedisStore.from_url(redis_server.url, timeout=5)
    try:
        record = await store.get(key)
        assert record is not None
        handle = dict(record.handle)
        handle["remote_blocks_expiry_time"] -= D_TTL
        expired = msgspec.structs.replace(record, handle=handle)
        assert (await store.commit(key, expired, now=time.time())).written
    finally:
        await store.close()
    r = await completion(client, real_router.url, prompt2, conversation=nonce)
    assert r.status_code == 200 and r.headers["x-carryover-path"] == "cold-error"
    assert same_output(r.json(), want, chat=False)
    assert (await ascrape(client, real_router.url))[rejected] - rejected_before == 1
    assert (await ascrape(client, p_url))["vllm:nixl_num_kv_expired_reqs_total"] >= 1
