"""What the real tier's tests share: prompts, calls to the router and the engines, and how an
answer is compared with the single-instance reference.

Correctness is judged against a reference (the same prompt on P with no kv_transfer_params) on
output token ids and on logprobs: a few wrong context tokens can leave greedy ids intact but
move logprobs by ~0.4 (docs/vllm-protocol.md §7). Where P keeps a prefix cache, the reference
carries a fresh ``cache_salt``, so nothing earlier can colour it.
"""

from __future__ import annotations

import random
import uuid
from typing import Any

import httpx

from carryover.bench.real.launch import SERVED_NAME, VllmPair
from carryover.state import HashedTokens, chunk_size_for
from tests.support.http import SAFE_TO_RESEND
from tests.support.metrics import ascrape
from tests.support.waiting import eventually

BLOCK = 128
PULLED = "vllm:prompt_tokens_by_source_total{source=external_kv_transfer}"
HITS = "vllm:prompt_tokens_by_source_total{source=local_cache_hit}"
COMPUTED = "vllm:prompt_tokens_by_source_total{source=local_compute}"
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


def urls(pair: VllmPair) -> tuple[str, str]:
    assert pair.prefill is not None and pair.decode is not None
    return pair.prefill.url, pair.decode.url


async def pulled(client: httpx.AsyncClient, p_url: str) -> float:
    return (await ascrape(client, p_url)).get(PULLED, 0.0)


async def tokenize(client: httpx.AsyncClient, url: str, **body: Any) -> list[int]:
    r = await client.post(
        url + "/tokenize", json={"model": SERVED_NAME, **body}, extensions=SAFE_TO_RESEND
    )
    r.raise_for_status()
    tokens: list[int] = r.json()["tokens"]
    return tokens


async def first_prompt(
    client: httpx.AsyncClient, p_url: str, nonce: str, words: int = 160
) -> list[int]:
    """A conversation's first prompt: one user message of ``words`` words, as P renders it."""
    return await tokenize(
        client,
        p_url,
        messages=[{"role": "user", "content": text(nonce, 0, words)}],
        add_generation_prompt=True,
    )


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


def salted() -> dict[str, Any]:
    """Request fields that keep a reference off every prefix cache. Never for a routed turn
    of a conversation: the client's salt is part of the conversation's key, so a fresh one
    starts a new conversation."""
    return {"cache_salt": uuid.uuid4().hex}


#: The router's count of the blocks its KV-event index holds for one instance.
INDEX_BLOCKS = "carryover_kv_index_blocks{{server={name}}}"


async def reset_prefix_cache(client: httpx.AsyncClient, url: str) -> None:
    """An engine's prefix cache emptied (dev mode's ``/reset_prefix_cache``). vLLM refuses
    the reset while any block is held (P's, until D has read them); sent twice, a reset
    changes nothing more than sent once."""
    await eventually(
        lambda: client.post(url + "/reset_prefix_cache", extensions=SAFE_TO_RESEND),
        lambda r: r.json()["success"] is True,
        what="the engine reset its prefix cache",
        timeout=120,
        interval=0.2,
    )


async def forget_prefill_cache(
    client: httpx.AsyncClient, p_url: str, router_url: str, model: str = SERVED_NAME
) -> None:
    """P's prefix cache emptied and the router's index told so (vLLM's
    ``AllBlocksCleared``): the next routed turn's P holds nothing of the conversation, pulls
    exactly what the handle covers, and the router knows a pull pays."""
    await reset_prefix_cache(client, p_url)
    # vLLM publishes events when its engine steps: a request shorter than a block makes it
    # step (and send AllBlocksCleared) and stores no block of its own.
    r = await client.post(
        p_url + "/v1/completions",
        json={"model": model, "prompt": [0], "max_tokens": 1, **salted()},
    )
    r.raise_for_status()
    blocks = INDEX_BLOCKS.format(name=p_url.removeprefix("http://"))
    await eventually(
        lambda: ascrape(client, router_url),
        lambda values: values.get(blocks, 0.0) == 0.0,
        what="the router's index forgot P's blocks",
        timeout=60,
    )


def expected_pull(prompt: list[int], sequence: list[int]) -> tuple[int, str]:
    """What P pulls for ``prompt`` with the handle of ``sequence`` (what D ran and holds, all
    but its last token), and the path the router names: all of it when ``prompt`` extends it,
    else the whole blocks before the first difference the router can see (none under vLLM's
    64-token threshold). The router keeps what it stored as digests of whole chunks and the
    tokens after them, and compares with ``TokenPrefix.common_length``: a difference inside
    a chunk cuts the reuse at that chunk's start."""
    r_tokens = len(sequence) - 1
    chunk = chunk_size_for(BLOCK)
    stored = HashedTokens(sequence, chunk).prefix(r_tokens, output_start=r_tokens)
    common = min(stored.common_length(HashedTokens(prompt, chunk)), r_tokens)
    if common == r_tokens and len(prompt) >= r_tokens:
        return r_tokens, "reuse"
    usable = min(common, len(prompt) - 1) // BLOCK * BLOCK
    return (usable, "partial") if usable >= 64 else (0, "cold-mismatch")
