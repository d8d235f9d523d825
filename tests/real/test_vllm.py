"""carryover in front of real vLLM (CPU build, NIXL, bidirectional KV transfer).

Correctness is judged against a single-instance reference (the same prompt on P with no
kv_transfer_params; P runs without a prefix cache, so nothing earlier can colour it) on output
token ids and on logprobs: a few wrong context tokens can leave greedy ids intact but move
logprobs by ~0.4 (docs/vllm-protocol.md §7).
"""

from __future__ import annotations

import asyncio
import random
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest

from bench.real.launch import SERVED_NAME, VllmPair
from router.auth import DEFAULT_TENANT
from state import ConversationKey, RedisStore
from tests.real.conftest import D_TTL, router_flags
from tests.support.metrics import ascrape
from tests.support.redis_server import RedisServer
from tests.support.router_proc import RouterProcess
from tests.support.waiting import eventually

pytestmark = pytest.mark.real

BLOCK = 128
PULLED = "vllm:prompt_tokens_by_source_total{source=external_kv_transfer}"
WORDS = [
    "river",
    "stone",
    "garden",
    "season",
    "winter",
    "leaf",
    "root",
    "water",
    "light",
    "shadow",
    "path",
    "wall",
    "gate",
    "bench",
    "moss",
    "fern",
    "oak",
    "pine",
    "willow",
    "rain",
    "frost",
    "soil",
    "seed",
    "bloom",
    "branch",
    "bird",
    "nest",
    "pond",
    "bridge",
    "hill",
]


def text(nonce: str, turn: int, words: int = 160) -> str:
    rng = random.Random(f"{nonce}:{turn}")  # str hash() is salted per process; this is not
    picked = [rng.choice(WORDS) for _ in range(words)]
    return f"[{nonce} turn {turn}] " + " ".join(picked)


@pytest.fixture
async def client() -> AsyncIterator[httpx.AsyncClient]:
    # vLLM closes idle connections after 5 s; a request sent on one at that moment is reset.
    limits = httpx.Limits(keepalive_expiry=2)
    async with httpx.AsyncClient(timeout=600, limits=limits) as c:
        yield c


def urls(pair: VllmPair) -> tuple[str, str]:
    assert pair.prefill is not None and pair.decode is not None
    return pair.prefill.url, pair.decode.url


async def pulled(client: httpx.AsyncClient, p_url: str) -> float:
    return (await ascrape(client, p_url)).get(PULLED, 0.0)


async def tokenize(client: httpx.AsyncClient, url: str, **body: Any) -> list[int]:
    r = await client.post(url + "/tokenize", json={"model": SERVED_NAME, **body})
    r.raise_for_status()
    tokens: list[int] = r.json()["tokens"]
    return tokens


def logprobs_of(body: dict[str, Any], chat: bool) -> list[float]:
    choice = body["choices"][0]
    if chat:
        return [item["logprob"] for item in choice["logprobs"]["content"]]
    values: list[float] = choice["logprobs"]["token_logprobs"]
    return values


def same_output(got: dict[str, Any], want: dict[str, Any], *, chat: bool) -> bool:
    if got["choices"][0]["token_ids"] != want["choices"][0]["token_ids"]:
        return False
    diffs = [
        abs(a - b) for a, b in zip(logprobs_of(got, chat), logprobs_of(want, chat), strict=True)
    ]
    return max(diffs, default=0.0) < 1e-3


async def completion(
    client: httpx.AsyncClient,
    url: str,
    prompt: list[int],
    *,
    max_tokens: int = 12,
    conversation: str | None = None,
    **extra: Any,
) -> httpx.Response:
    body: dict[str, Any] = {
        "model": SERVED_NAME,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
        "logprobs": 1,
        **extra,
    }
    if conversation:
        body["conversation_id"] = conversation
    return await client.post(url + "/v1/completions", json=body)


async def chat(
    client: httpx.AsyncClient,
    url: str,
    messages: list[dict[str, Any]],
    *,
    max_tokens: int = 12,
    conversation: str | None = None,
    **extra: Any,
) -> httpx.Response:
    body: dict[str, Any] = {
        "model": SERVED_NAME,
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
        "logprobs": True,
        "top_logprobs": 1,
        **extra,
    }
    if conversation:
        body["conversation_id"] = conversation
    return await client.post(url + "/v1/chat/completions", json=body)


async def test_completions_full_reuse_over_five_turns(
    client: httpx.AsyncClient, vllm_pair: VllmPair, real_router: RouterProcess
) -> None:
    p_url, _ = urls(vllm_pair)
    nonce = uuid.uuid4().hex[:8]
    prompt = await tokenize(
        client,
        p_url,
        messages=[{"role": "user", "content": text(nonce, 0)}],
        add_generation_prompt=True,
    )
    # The whole conversation on P alone first: its answers are the reference, and the routed
    # turns then follow each other without a slow reference call in between.
    prompts: list[list[int]] = []
    wants: list[dict[str, Any]] = []
    for turn in range(5):
        want = (await completion(client, p_url, prompt)).json()
        prompts.append(prompt)
        wants.append(want)
        suffix = f"<|im_end|>\n<|im_start|>user\n{text(nonce, turn + 1, 60)}<|im_end|>\n<|im_start|>assistant\n"
        output = want["choices"][0]["token_ids"]
        prompt = prompt + output + await tokenize(client, p_url, prompt=suffix)
    previous_r = None
    for turn, (prompt, want) in enumerate(zip(prompts, wants, strict=True)):
        before = await pulled(client, p_url)
        r = await completion(client, real_router.url, prompt, conversation=nonce)
        assert r.status_code == 200, r.text
        got = r.json()
        after = await pulled(client, p_url)
        assert same_output(got, want, chat=False), f"turn {turn + 1} differs from the reference"
        # What the client is told was not computed: P's count (P has no prefix cache here, so
        # only what it pulled), not D's, which got every prompt token over the transfer.
        cached = got["usage"]["prompt_tokens_details"]["cached_tokens"]
        if turn == 0:
            assert r.headers["x-carryover-path"] == "cold-miss"
            assert cached == 0
        else:
            assert r.headers["x-carryover-path"] == "reuse"
            assert after - before == previous_r  # P pulled all of D's history
            assert cached == previous_r
        previous_r = len(prompt) + len(got["choices"][0]["token_ids"]) - 1


async def test_the_router_renders_in_process_only_because_vllm_agrees(
    client: httpx.AsyncClient, vllm_pair: VllmPair, real_router: RouterProcess
) -> None:
    """The default renderer compared its ids with vLLM's /tokenize on the probe prompts and
    found them equal; then a chat turn's ids are the ones vLLM itself renders."""
    p_url, _ = urls(vllm_pair)
    agrees = "carryover_render_check{model=0,state=agrees}"
    await eventually(
        lambda: ascrape(client, real_router.url),
        lambda values: values.get(agrees) == 1.0,
        what="the router's renderer agrees with vLLM's",
        timeout=120,
    )
    messages = [
        {"role": "system", "content": "Answer in one line."},
        {"role": "user", "content": f"{uuid.uuid4().hex[:8]}: name a river."},
    ]
    r = await chat(client, real_router.url, messages)
    assert r.status_code == 200, r.text
    want = await tokenize(client, p_url, messages=messages, add_generation_prompt=True)
    assert r.json()["usage"]["prompt_tokens"] == len(want)


async def test_the_kv_index_follows_vllms_own_events(
    client: httpx.AsyncClient, vllm_pair: VllmPair, real_router: RouterProcess
) -> None:
    """The router's index, fed by D's KV events, says D holds what D's own prefix-cache
    counter then shows it did not compute (docs/kv-events.md)."""
    p_url, d_url = urls(vllm_pair)
    assert vllm_pair.decode is not None
    d_name = vllm_pair.decode.url.removeprefix("http://")
    nonce = uuid.uuid4().hex[:8]
    prompt = await tokenize(
        client,
        p_url,
        messages=[{"role": "user", "content": text(nonce, 0)}],
        add_generation_prompt=True,
    )
    r = await completion(client, real_router.url, prompt, conversation=nonce)
    assert r.status_code == 200, r.text
    output = r.json()["choices"][0]["token_ids"]
    history = len(prompt) + len(output) - 1  # what D ran and keeps
    blocks = f"carryover_kv_index_blocks{{instance={d_name}}}"
    await eventually(
        lambda: ascrape(client, real_router.url),
        lambda values: values.get(blocks, 0.0) >= history // BLOCK,
        what="the index holds D's blocks of the first turn",
        timeout=120,
    )
    router = await ascrape(client, real_router.url)
    for why in ("undecodable", "unknown_event"):
        assert (
            router.get(f"carryover_kv_events_skipped_total{{instance={d_name},why={why}}}", 0) == 0
        )
    suffix = (
        f"<|im_end|>\n<|im_start|>user\n{text(nonce, 1, 40)}<|im_end|>\n<|im_start|>assistant\n"
    )
    second = prompt + output + await tokenize(client, p_url, prompt=suffix)
    said = "carryover_kv_cached_tokens_total{leg=decode}"
    hits = "vllm:prompt_tokens_by_source_total{source=local_cache_hit}"
    said_before = router.get(said, 0.0)
    hits_before = (await ascrape(client, d_url)).get(hits, 0.0)
    r = await completion(client, real_router.url, second, conversation=nonce)
    assert r.status_code == 200, r.text
    said_delta = (await ascrape(client, real_router.url)).get(said, 0.0) - said_before
    hits_delta = (await ascrape(client, d_url)).get(hits, 0.0) - hits_before
    assert said_delta >= history // BLOCK * BLOCK
    # vLLM leaves at least the prompt's last token to compute.
    assert hits_delta == min(said_delta, (len(second) - 1) // BLOCK * BLOCK)


async def test_chat_echo_reuses_exactly_the_blocks_before_the_answer(
    client: httpx.AsyncClient, vllm_pair: VllmPair, real_router: RouterProcess
) -> None:
    # A random-weight model's ids do not survive detokenize -> retokenize: every turn's prompt
    # diverges inside the previous answer, and only whole blocks before that are reusable.
    p_url, _ = urls(vllm_pair)
    # A fixed text: the seeded model then answers the same every run, so whether an answer
    # re-tokenizes to its own ids does not change from run to run.
    nonce = "echo-0001"
    messages: list[dict[str, Any]] = [{"role": "user", "content": text(nonce, 0, 300)}]
    sequence: list[int] | None = None
    diverged_inside_history = 0
    for turn in range(5):
        before = await pulled(client, p_url)
        r = await chat(client, real_router.url, messages, max_tokens=40, conversation=nonce)
        assert r.status_code == 200, r.text
        got = r.json()
        after = await pulled(client, p_url)
        want = (await chat(client, p_url, messages, max_tokens=40)).json()
        assert same_output(got, want, chat=True), f"turn {turn + 1} differs from the reference"
        prompt = got["prompt_token_ids"]
        if sequence is not None:
            r_tokens = len(sequence) - 1
            common = next(
                (
                    i
                    for i, (a, b) in enumerate(zip(prompt, sequence[:r_tokens], strict=False))
                    if a != b
                ),
                min(len(prompt), r_tokens),
            )
            diverged_inside_history += common < r_tokens
            usable = min(common, len(prompt) - 1) // BLOCK * BLOCK
            expected = r_tokens if common == r_tokens else usable if usable >= 64 else 0
            path = r.headers["x-carryover-path"]
            assert after - before == expected, (path, common, r_tokens)
            assert path == (
                "reuse" if common == r_tokens else "partial" if expected else "cold-mismatch"
            )
        sequence = prompt + got["choices"][0]["token_ids"]
        messages += [
            {"role": "assistant", "content": got["choices"][0]["message"]["content"]},
            {"role": "user", "content": text(nonce, turn + 1, 40)},
        ]
    assert diverged_inside_history >= 1


async def test_rewritten_history_and_stripped_answer_stay_correct(
    client: httpx.AsyncClient, vllm_pair: VllmPair, real_router: RouterProcess
) -> None:
    p_url, _ = urls(vllm_pair)
    nonce = uuid.uuid4().hex[:8]
    messages: list[dict[str, Any]] = [{"role": "user", "content": text(nonce, 0, 300)}]
    first = (
        await chat(client, real_router.url, messages, max_tokens=60, conversation=nonce)
    ).json()
    answer = first["choices"][0]["message"]["content"]
    # The client sends the answer back with its leading part removed (as Qwen3's template does
    # to reasoning).
    messages += [
        {"role": "assistant", "content": answer[len(answer) // 3 :]},
        {"role": "user", "content": text(nonce, 1, 40)},
    ]
    r = await chat(client, real_router.url, messages, conversation=nonce)
    assert r.headers["x-carryover-path"] in ("partial", "cold-mismatch")
    assert same_output(r.json(), (await chat(client, p_url, messages)).json(), chat=True)
    # A client rewriting an earlier message.
    messages[0] = {"role": "user", "content": text(nonce, 0, 150) + " (edited)"}
    messages += [
        {"role": "assistant", "content": r.json()["choices"][0]["message"]["content"]},
        {"role": "user", "content": text(nonce, 2, 40)},
    ]
    r = await chat(client, real_router.url, messages, conversation=nonce)
    assert r.status_code == 200 and r.headers["x-carryover-path"] in ("partial", "cold-mismatch")
    assert same_output(r.json(), (await chat(client, p_url, messages)).json(), chat=True)


async def test_a_truncated_prompt_runs_unchecked_and_right(
    client: httpx.AsyncClient, vllm_pair: VllmPair, real_router: RouterProcess
) -> None:
    # vLLM keeps the last k ids of a token prompt under truncate_prompt_tokens. With the stored
    # handle attached, P would pull D's history for ids it no longer runs; the router runs
    # such a turn unchecked: nothing pulled, the engines truncate, the answer is right.
    p_url, _ = urls(vllm_pair)
    nonce = uuid.uuid4().hex[:8]
    prompt = await tokenize(
        client,
        p_url,
        messages=[{"role": "user", "content": text(nonce, 0, 300)}],
        add_generation_prompt=True,
    )
    first = await completion(client, real_router.url, prompt, conversation=nonce)
    assert first.status_code == 200 and first.headers["x-carryover-path"] == "cold-miss"
    longer = prompt + first.json()["choices"][0]["token_ids"] + prompt[:60]
    extra = {"truncate_prompt_tokens": len(longer) - 200}
    want = (await completion(client, p_url, longer, **extra)).json()
    before = await pulled(client, p_url)
    r = await completion(client, real_router.url, longer, conversation=nonce, **extra)
    assert r.status_code == 200, r.text
    assert r.headers["x-carryover-path"] == "cold-unchecked"
    assert await pulled(client, p_url) == before  # nothing read from D
    assert same_output(r.json(), want, chat=False)


async def test_the_same_mismatch_without_the_router_is_wrong(
    client: httpx.AsyncClient, vllm_pair: VllmPair
) -> None:
    # What the check prevents: vLLM #43094 on the CPU build, straight to P and D.
    p_url, d_url = urls(vllm_pair)
    nonce = uuid.uuid4().hex[:8]
    t1 = await tokenize(
        client,
        p_url,
        messages=[{"role": "user", "content": text(nonce, 0, 300)}],
        add_generation_prompt=True,
    )
    p1 = (
        await completion(
            client, p_url, t1, max_tokens=1, kv_transfer_params={"do_remote_decode": True}
        )
    ).json()
    d1 = (
        await completion(
            client, d_url, t1, max_tokens=150, kv_transfer_params=p1["kv_transfer_params"]
        )
    ).json()
    handle = d1["kv_transfer_params"]
    output = d1["choices"][0]["token_ids"]
    suffix = await tokenize(
        client,
        p_url,
        prompt=f"<|im_end|>\n<|im_start|>user\n{text(nonce, 1, 30)}<|im_end|>\n<|im_start|>assistant\n",
    )
    stripped = t1 + output[100:] + suffix  # the first 100 output tokens dropped
    p2 = (await completion(client, p_url, stripped, max_tokens=1, kv_transfer_params=handle)).json()
    d2 = (
        await completion(
            client, d_url, stripped, max_tokens=12, kv_transfer_params=p2["kv_transfer_params"]
        )
    ).json()
    want = (await completion(client, p_url, stripped)).json()
    assert not same_output(d2, want, chat=False)


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
    # The same conversation id with an unrelated history: nothing is reusable, so the old
    # handle goes to P with remote_num_tokens 0 and D frees it while this turn runs.
    other = [{"role": "user", "content": "x " + text(nonce + "b", 0, 30)}]
    r2 = await chat(client, real_router.url, other, conversation=nonce)
    assert r2.headers["x-carryover-path"] == "cold-mismatch"
    blocks2 = -(
        -(len(r2.json()["prompt_token_ids"]) + len(r2.json()["choices"][0]["token_ids"]) - 1)
        // BLOCK
    )
    held = round(((await ascrape(client, d_url))[usage] - u0) * total_blocks)
    assert held == blocks2  # turn 1's are gone
    deleted = await client.delete(f"{real_router.url}/v1/conversations/{nonce}")
    assert deleted.json() == {"id": nonce, "deleted": True, "released": True}
    # At once, not after the TTL.
    assert round(((await ascrape(client, d_url))[usage] - u0) * total_blocks) == 0


async def test_streaming_on_032_returns_no_handle_and_next_turn_is_cold(
    client: httpx.AsyncClient, vllm_pair: VllmPair, real_router: RouterProcess
) -> None:
    p_url, _ = urls(vllm_pair)
    nonce = uuid.uuid4().hex[:8]
    messages: list[dict[str, Any]] = [{"role": "user", "content": text(nonce, 0, 200)}]
    body = {
        "model": SERVED_NAME,
        "messages": messages,
        "max_tokens": 12,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "conversation_id": nonce,
    }
    content = ""
    async with client.stream("POST", real_router.url + "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200
        lines = [line async for line in r.aiter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    import json

    for line in lines[:-1]:
        chunk = json.loads(line[6:])
        assert "error" not in chunk and "kv_transfer_params" not in chunk
        content += "".join((c.get("delta") or {}).get("content") or "" for c in chunk["choices"])
    want = (await chat(client, p_url, messages)).json()["choices"][0]["message"]["content"]
    assert content == want
    messages += [
        {"role": "assistant", "content": content},
        {"role": "user", "content": text(nonce, 1, 30)},
    ]
    r2 = await chat(client, real_router.url, messages, conversation=nonce)
    assert r2.status_code == 200 and r2.headers["x-carryover-path"] == "cold-miss"
    metrics = await ascrape(client, real_router.url)
    assert metrics["carryover_turns_without_handle_total{cause=streamed_before_0.33}"] >= 1


async def test_prefill_unavailable_decode_serves_alone_and_reuse_continues(
    client: httpx.AsyncClient, vllm_pair: VllmPair, real_router: RouterProcess
) -> None:
    # "P down" as the router sees it: drained (restarting a real P alone while D runs hangs its
    # start on this machine, so the pair is never split).
    p_url, _ = urls(vllm_pair)
    nonce = uuid.uuid4().hex[:8]
    admin = {"Authorization": "Bearer admin-secret"}
    p_name = p_url.removeprefix("http://")
    messages: list[dict[str, Any]] = [{"role": "user", "content": text(nonce, 0, 300)}]
    drained = await client.post(f"{real_router.url}/admin/instances/{p_name}/drain", headers=admin)
    assert drained.json()["draining"] is True
    try:
        r1 = await chat(client, real_router.url, messages, conversation=nonce)
        assert r1.status_code == 200
        assert same_output(r1.json(), (await chat(client, p_url, messages)).json(), chat=True)
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
    r2 = await completion(client, real_router.url, prompt + suffix, conversation=nonce)
    # The completions turn continues the same conversation id only within its own model/tenant
    # key: the chat record is found and reused because the ids extend it exactly.
    assert r2.headers["x-carryover-path"] == "reuse"
    assert await pulled(client, p_url) - before == len(prompt) - 1
    assert same_output(
        r2.json(), (await completion(client, p_url, prompt + suffix)).json(), chat=False
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
    prompt = await tokenize(
        client,
        p_url,
        messages=[{"role": "user", "content": text(nonce, 0, 300)}],
        add_generation_prompt=True,
    )
    prompt2_tail = [198] * 20
    first = (await completion(client, real_router.url, prompt, conversation=nonce)).json()
    prompt2 = prompt + first["choices"][0]["token_ids"] + prompt2_tail
    want = (await completion(client, p_url, prompt2)).json()
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
    metrics = await ascrape(client, real_router.url)
    assert metrics["carryover_retries_total{cause=prefill_handle_rejected}"] == 1
    assert (await ascrape(client, p_url))["vllm:nixl_num_kv_expired_reqs_total"] >= 1


async def test_zz_decode_restart_makes_records_stale(
    client: httpx.AsyncClient, vllm_pair: VllmPair, redis_server: RedisServer, tmp_path: Path
) -> None:
    # Last in the module: it restarts the pair (P and D together, as this machine needs) on the
    # same ports. D comes back with a new engine id; the router sees the restart and bumps D's
    # epoch, so the stored handle is stale: the next turn is cold without ever sending it (a
    # sent stale handle would show as a P 500 and the path "cold-error"). The record outlives
    # the minute-long restart (D_TTL).
    router = RouterProcess(router_flags(vllm_pair, redis_server), tmp_path)
    await router.start(timeout=180)
    try:
        nonce = uuid.uuid4().hex[:8]
        messages: list[dict[str, Any]] = [{"role": "user", "content": text(nonce, 0, 300)}]
        r1 = await chat(client, router.url, messages, conversation=nonce)
        assert r1.status_code == 200
        _, d_url = urls(vllm_pair)
        d_name = d_url.removeprefix("http://")
        # The index holds what D kept of every turn of this tier (its pins last an hour).
        blocks = f"carryover_kv_index_blocks{{instance={d_name}}}"
        held = await eventually(
            lambda: ascrape(client, router.url),
            lambda m: m.get(blocks, 0) >= 1,
            what="the new router's index replayed D's blocks",
            timeout=120,
        )
        await asyncio.to_thread(vllm_pair.restart)
        await asyncio.to_thread(vllm_pair.warm_up)
        restarts = f"carryover_instance_restarts_total{{instance={d_name},role=decode}}"
        resets = f"carryover_kv_index_resets_total{{cause=restart,instance={d_name}}}"
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
        p_url, _ = urls(vllm_pair)
        assert same_output(r2.json(), (await chat(client, p_url, messages)).json(), chat=True)
        assert "prefill_handle_rejected" not in (await client.get(router.url + "/metrics")).text
    finally:
        router.stop()
