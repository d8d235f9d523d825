"""carryover in front of real vLLM (CPU build, NIXL, bidirectional KV transfer): reuse, the
prefix check and what it guards against. Before every routed turn whose pull is counted, P's
prefix cache is emptied (``forget_prefill_cache``), and every reference carries a fresh
``cache_salt``: P finds nothing of its own, so its counters say exactly what was pulled. (A
routed turn keeps its conversation's salt: the salt is part of the conversation's key.)
"""

from __future__ import annotations

import json
import uuid
from typing import Any

import httpx
import pytest

from carryover.bench.real.launch import VllmPair
from tests.real.helpers import (
    SERVED_NAME,
    chat,
    completion,
    expected_pull,
    first_prompt,
    forget_prefill_cache,
    pulled,
    salted,
    same_output,
    text,
    tokenize,
    urls,
)
from tests.support.metrics import ascrape
from tests.support.router_proc import RouterProcess
from tests.support.waiting import eventually

pytestmark = [pytest.mark.real, pytest.mark.engines("pd")]


async def test_completions_full_reuse_over_five_turns(
    client: httpx.AsyncClient, vllm_pair: VllmPair, real_router: RouterProcess
) -> None:
    p_url, _ = urls(vllm_pair)
    nonce = uuid.uuid4().hex[:8]
    prompt = await first_prompt(client, p_url, nonce)
    # The whole conversation on P alone first: its answers are the reference, and the routed
    # turns then follow each other without a slow reference call in between.
    prompts: list[list[int]] = []
    wants: list[dict[str, Any]] = []
    for turn in range(5):
        want = (await completion(client, p_url, prompt, **salted())).json()
        prompts.append(prompt)
        wants.append(want)
        suffix = f"<|im_end|>\n<|im_start|>user\n{text(nonce, turn + 1, 60)}<|im_end|>\n<|im_start|>assistant\n"
        output = want["choices"][0]["token_ids"]
        prompt = prompt + output + await tokenize(client, p_url, prompt=suffix)
    previous_r = None
    for turn, (prompt, want) in enumerate(zip(prompts, wants, strict=True)):
        await forget_prefill_cache(client, p_url, real_router.url)
        before = await pulled(client, p_url)
        r = await completion(client, real_router.url, prompt, conversation=nonce)
        assert r.status_code == 200, r.text
        got = r.json()
        after = await pulled(client, p_url)
        assert same_output(got, want, chat=False), f"turn {turn + 1} differs from the reference"
        # What the client is told was not computed: P's count (nothing of P's own cache, which
        # was emptied, so only what it pulled), not D's, which got every prompt token over
        # the transfer.
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
    assert r.json()["prompt_token_ids"] == want
    assert r.json()["usage"]["prompt_tokens"] == len(want)


async def test_chat_echo_reuses_exactly_the_blocks_before_the_answer(
    client: httpx.AsyncClient, vllm_pair: VllmPair, real_router: RouterProcess
) -> None:
    # A random-weight model's ids do not survive detokenize -> retokenize: every turn's prompt
    # diverges inside the previous answer, and only whole blocks before that are reusable.
    p_url, _ = urls(vllm_pair)
    # A fixed text: the seeded model then answers the same every run, so whether an answer
    # re-tokenizes to its own ids does not change from run to run.
    nonce = "echo-0003"  # its turns: a cold miss, a divergence inside the answer, a reuse
    messages: list[dict[str, Any]] = [{"role": "user", "content": text(nonce, 0, 300)}]
    sequence: list[int] | None = None
    diverged_inside_history = 0
    for turn in range(3):
        await forget_prefill_cache(client, p_url, real_router.url)
        before = await pulled(client, p_url)
        r = await chat(client, real_router.url, messages, max_tokens=40, conversation=nonce)
        assert r.status_code == 200, r.text
        got = r.json()
        after = await pulled(client, p_url)
        want = (await chat(client, p_url, messages, max_tokens=40, **salted())).json()
        assert same_output(got, want, chat=True), f"turn {turn + 1} differs from the reference"
        prompt = got["prompt_token_ids"]
        if sequence is not None:
            expected, path = expected_pull(prompt, sequence)
            diverged_inside_history += path != "reuse"
            assert after - before == expected, (r.headers["x-carryover-path"], expected, path)
            assert r.headers["x-carryover-path"] == path
        sequence = prompt + got["choices"][0]["token_ids"]
        messages += [
            {"role": "assistant", "content": got["choices"][0]["message"]["content"]},
            {"role": "user", "content": text(nonce, turn + 1, 40)},
        ]
    assert diverged_inside_history >= 1


async def test_rewritten_history_and_stripped_answer_stay_correct(
    client: httpx.AsyncClient, vllm_pair: VllmPair, real_router: RouterProcess
) -> None:
    """Each later turn pulls exactly the whole blocks before its first difference from what D
    holds, and answers as P alone does."""
    p_url, _ = urls(vllm_pair)
    nonce = uuid.uuid4().hex[:8]
    messages: list[dict[str, Any]] = [{"role": "user", "content": text(nonce, 0, 300)}]
    first = (
        await chat(client, real_router.url, messages, max_tokens=60, conversation=nonce)
    ).json()
    sequence = first["prompt_token_ids"] + first["choices"][0]["token_ids"]
    answer = first["choices"][0]["message"]["content"]
    # The client sends the answer back with its leading part removed (as Qwen3's template does
    # to reasoning).
    messages += [
        {"role": "assistant", "content": answer[len(answer) // 3 :]},
        {"role": "user", "content": text(nonce, 1, 40)},
    ]

    async def checked_turn(sequence: list[int]) -> dict[str, Any]:
        await forget_prefill_cache(client, p_url, real_router.url)
        before = await pulled(client, p_url)
        r = await chat(client, real_router.url, messages, conversation=nonce)
        assert r.status_code == 200, r.text
        expected, path = expected_pull(r.json()["prompt_token_ids"], sequence)
        assert path != "reuse" and r.headers["x-carryover-path"] == path, expected
        assert await pulled(client, p_url) - before == expected, path
        want = (await chat(client, p_url, messages, **salted())).json()
        assert same_output(r.json(), want, chat=True)
        got: dict[str, Any] = r.json()
        return got

    second = await checked_turn(sequence)
    # A client rewriting an earlier message.
    messages[0] = {"role": "user", "content": text(nonce, 0, 150) + " (edited)"}
    messages += [
        {"role": "assistant", "content": second["choices"][0]["message"]["content"]},
        {"role": "user", "content": text(nonce, 2, 40)},
    ]
    await checked_turn(second["prompt_token_ids"] + second["choices"][0]["token_ids"])


async def test_a_truncated_prompt_runs_unchecked_and_right(
    client: httpx.AsyncClient, vllm_pair: VllmPair, real_router: RouterProcess
) -> None:
    # vLLM keeps the last k ids of a token prompt under truncate_prompt_tokens. With the stored
    # handle attached, P would pull D's history for ids it no longer runs; the router runs
    # such a turn unchecked: nothing pulled, the engines truncate, the answer is right.
    p_url, _ = urls(vllm_pair)
    nonce = uuid.uuid4().hex[:8]
    prompt = await first_prompt(client, p_url, nonce, 300)
    first = await completion(client, real_router.url, prompt, conversation=nonce)
    assert first.status_code == 200 and first.headers["x-carryover-path"] == "cold-miss"
    longer = prompt + first.json()["choices"][0]["token_ids"] + prompt[:60]
    extra = {"truncate_prompt_tokens": len(longer) - 200}
    want = (await completion(client, p_url, longer, **extra, **salted())).json()
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
    t1 = await first_prompt(client, p_url, nonce, 300)
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
    # Salted: P's own cache of t1 would otherwise supply the blocks before the difference.
    p2 = (
        await completion(
            client, p_url, stripped, max_tokens=1, kv_transfer_params=handle, **salted()
        )
    ).json()
    d2 = (
        await completion(
            client, d_url, stripped, max_tokens=12, kv_transfer_params=p2["kv_transfer_params"]
        )
    ).json()
    want = (await completion(client, p_url, stripped, **salted())).json()
    assert not same_output(d2, want, chat=False)


async def test_streaming_on_032_returns_no_handle_and_next_turn_is_cold(
    client: httpx.AsyncClient, vllm_pair: VllmPair, real_router: RouterProcess
) -> None:
    _, d_url = urls(vllm_pair)
    nonce = uuid.uuid4().hex[:8]
    messages: list[dict[str, Any]] = [{"role": "user", "content": text(nonce, 0, 200)}]
    unstreamed = "carryover_turns_without_handle_total{cause=streamed_before_0.33}"
    unstreamed_before = (await ascrape(client, real_router.url)).get(unstreamed, 0)
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

    for line in lines[:-1]:
        chunk = json.loads(line[6:])
        assert "error" not in chunk and "kv_transfer_params" not in chunk
        content += "".join((c.get("delta") or {}).get("content") or "" for c in chunk["choices"])
    # D alone is the reference: P parses reasoning out of its content, as vllm serve with the
    # render server's parsers does; D, like the router, passes the text on as it is.
    want = (await chat(client, d_url, messages, **salted())).json()
    assert content == want["choices"][0]["message"]["content"]
    messages += [
        {"role": "assistant", "content": content},
        {"role": "user", "content": text(nonce, 1, 30)},
    ]
    r2 = await chat(client, real_router.url, messages, conversation=nonce)
    assert r2.status_code == 200 and r2.headers["x-carryover-path"] == "cold-miss"
    # The one streamed turn left no handle, and says so once.
    assert (await ascrape(client, real_router.url))[unstreamed] - unstreamed_before == 1
