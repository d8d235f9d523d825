"""Each vLLM P/D semantic the simulator promises, pinned by its own test.

The reference for "correct" is always a fresh instance with no kv params and an empty cache.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from carryover.bench.sim.kv import SEED, BlockPool, chain
from carryover.bench.sim.server import SimServer
from tests.sim.helpers import LONG, chat_body, output_ids, pd_chat, post, reference, tokenize, user
from tests.support.metrics import ascrape
from tests.support.sims import MODEL, pd_pair, running, sim_config
from tests.support.waiting import eventually


@pytest.fixture
async def client() -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(timeout=10) as c:
        yield c


@pytest.fixture
async def ref() -> AsyncIterator[SimServer]:
    async with running(sim_config(None)) as server:
        yield server


def turn2_messages(first: list[dict[str, Any]], answer: str) -> list[dict[str, Any]]:
    return [*first, {"role": "assistant", "content": answer}, user(LONG + "What next?")]


async def test_p_to_d_transfer_gives_the_reference_answer(
    client: httpx.AsyncClient, ref: SimServer
) -> None:
    async with pd_pair() as (p, d):
        body = chat_body([user(LONG)])
        d_json, p_json = await pd_chat(client, p, d, body)
        assert output_ids(d_json) == await reference(client, ref, body)
        params = p_json["kv_transfer_params"]
        assert params["do_remote_prefill"] is True and params["remote_num_tokens"] == len(
            d_json["prompt_token_ids"]
        )
        d_metrics = await ascrape(client, d.url)
        assert d_metrics["vllm:prompt_tokens_by_source_total{source=external_kv_transfer}"] == len(
            d_json["prompt_token_ids"]
        )
        # D's end-of-turn handle: prompt + output - 1 tokens, cdiv(R, 16) blocks, D's own clock.
        handle = d_json["kv_transfer_params"]
        r = len(d_json["prompt_token_ids"]) + len(output_ids(d_json)) - 1
        assert handle["do_remote_decode"] is True and handle["remote_num_tokens"] == r
        assert len(handle["remote_block_ids"][0]) == -(-r // 16)
        assert abs(handle["remote_blocks_expiry_time"] - (time.monotonic() + 480)) < 5


async def test_bidirectional_turn_two_reuses_correctly(
    client: httpx.AsyncClient, ref: SimServer
) -> None:
    async with pd_pair(p_enable_prefix_caching=False) as (p, d):
        first = [user(LONG * 3)]
        d1, _ = await pd_chat(client, p, d, chat_body(first))
        body2 = chat_body(turn2_messages(first, d1["choices"][0]["message"]["content"]))
        before = await ascrape(client, p.url)
        d2, p2 = await pd_chat(client, p, d, body2, d1["kv_transfer_params"])
        after = await ascrape(client, p.url)
        pulled = (
            after["vllm:prompt_tokens_by_source_total{source=external_kv_transfer}"]
            - before["vllm:prompt_tokens_by_source_total{source=external_kv_transfer}"]
        )
        assert pulled == d1["kv_transfer_params"]["remote_num_tokens"]
        assert p2["kv_transfer_params"]["remote_prefill_cached_tokens"] == pulled
        assert output_ids(d2) == await reference(client, ref, body2)
        assert (
            d1["kv_transfer_params"]["remote_request_id"]
            not in (await client.get(d.url + "/sim/state")).json()["held_requests"]
        )


async def test_reasoning_stripped_turn_two_reuses_wrongly_and_poisons_p(
    client: httpx.AsyncClient, ref: SimServer
) -> None:
    # vLLM #43094: Qwen3 drops <think> of earlier turns; P trusts the handle anyway.
    thinking = {"chat_template_kwargs": {"enable_thinking": True}}
    async with pd_pair(p_enable_prefix_caching=True) as (p, d):
        first = [user(LONG * 3)]
        d1, _ = await pd_chat(client, p, d, chat_body(first, 150, ignore_eos=True, **thinking))
        message = d1["choices"][0]["message"]
        assert message["reasoning_content"] and "<think>" not in message["content"]
        body2 = chat_body(turn2_messages(first, message["content"]), **thinking)
        n2 = await tokenize(client, p, body2["messages"])
        s_d = d1["prompt_token_ids"] + output_ids(d1)
        r = d1["kv_transfer_params"]["remote_num_tokens"]
        assert n2[:r] != s_d[:r]  # the mismatch a router must catch
        d2, _ = await pd_chat(client, p, d, body2, d1["kv_transfer_params"])
        expected = await reference(client, ref, body2)
        assert output_ids(d2) != expected
        # The wrong blocks were cached on P under this prompt's hashes: a plain request is wrong too.
        plain = await post(client, p, "/v1/chat/completions", body2)
        assert output_ids(plain.json()) != expected


async def test_shorter_prompt_that_is_a_prefix_gets_the_tail_blocks(
    client: httpx.AsyncClient, ref: SimServer
) -> None:
    async with pd_pair(p_enable_prefix_caching=False, threshold=0) as (p, d):
        prompt = await tokenize(client, p, [user(LONG * 4)])
        body = {
            "model": MODEL,
            "prompt": prompt,
            "max_tokens": 40,
            "return_token_ids": True,
            "ignore_eos": True,
        }
        rp = (
            await post(
                client,
                p,
                "/v1/completions",
                {**body, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}},
            )
        ).json()
        rd = (
            await post(
                client,
                d,
                "/v1/completions",
                {**body, "kv_transfer_params": rp["kv_transfer_params"]},
            )
        ).json()
        handle = rd["kv_transfer_params"]
        shorter = prompt[: len(prompt) - 37]  # an exact prefix needing fewer blocks
        short_body = {**body, "prompt": shorter, "max_tokens": 8}
        got = (
            await post(client, p, "/v1/completions", {**short_body, "kv_transfer_params": handle})
        ).json()
        want = (await post(client, ref, "/v1/completions", short_body)).json()
        assert got["choices"][0]["token_ids"] != want["choices"][0]["token_ids"]


async def test_truncated_handle_is_read_correctly(
    client: httpx.AsyncClient, ref: SimServer
) -> None:
    async with pd_pair(p_enable_prefix_caching=False, threshold=0) as (p, d):
        first = [user(LONG * 3)]
        d1, _ = await pd_chat(
            client, p, d, chat_body(first, 60, chat_template_kwargs={"enable_thinking": True})
        )
        handle = d1["kv_transfer_params"]
        body2 = chat_body(turn2_messages(first, d1["choices"][0]["message"]["content"]))
        n2 = await tokenize(client, p, body2["messages"])
        s_d = d1["prompt_token_ids"] + output_ids(d1)
        common = next(i for i, (a, b) in enumerate(zip(n2, s_d, strict=False)) if a != b)
        keep = common // 16
        cut = {
            **handle,
            "remote_num_tokens": keep * 16,
            "remote_block_ids": [handle["remote_block_ids"][0][:keep]],
        }
        d2, p2 = await pd_chat(client, p, d, body2, cut)
        assert p2["kv_transfer_params"]["remote_prefill_cached_tokens"] == keep * 16
        assert output_ids(d2) == await reference(client, ref, body2)


async def test_release_with_zero_tokens_frees_d_now(
    client: httpx.AsyncClient, ref: SimServer
) -> None:
    async with pd_pair() as (p, d):
        first = [user(LONG * 2)]
        d1, _ = await pd_chat(client, p, d, chat_body(first))
        handle = d1["kv_transfer_params"]
        held = (await client.get(d.url + "/sim/state")).json()["held_requests"]
        assert handle["remote_request_id"] in held
        body2 = chat_body([user("something else entirely " * 20)])
        d2, p2 = await pd_chat(client, p, d, body2, {**handle, "remote_num_tokens": 0})
        held = (await client.get(d.url + "/sim/state")).json()["held_requests"]
        assert handle["remote_request_id"] not in held
        assert p2["kv_transfer_params"]["remote_prefill_cached_tokens"] == 0
        assert output_ids(d2) == await reference(client, ref, body2)


async def test_below_threshold_pull_is_skipped_and_releases(client: httpx.AsyncClient) -> None:
    async with pd_pair(threshold=10_000) as (p, d):
        first = [user(LONG)]
        d1, _ = await pd_chat(client, p, d, chat_body(first))
        handle = d1["kv_transfer_params"]
        body2 = chat_body(turn2_messages(first, d1["choices"][0]["message"]["content"]))
        await pd_chat(client, p, d, body2, handle)
        p_metrics = await ascrape(client, p.url)
        assert p_metrics["vllm:prompt_tokens_by_source_total{source=external_kv_transfer}"] == 0
        assert (
            handle["remote_request_id"]
            not in (await client.get(d.url + "/sim/state")).json()["held_requests"]
        )


async def test_expired_handle_fails_fast_with_500(client: httpx.AsyncClient) -> None:
    async with pd_pair(p_enable_prefix_caching=False) as (p, d):
        first = [user(LONG * 2)]
        d1, _ = await pd_chat(client, p, d, chat_body(first))
        # D's clock moves past the pin's TTL (480 s) minus P's 5 s safety margin.
        await post(client, d, "/sim/faults", {"advance_clock": 476})
        body2 = chat_body(turn2_messages(first, d1["choices"][0]["message"]["content"]))
        # Declined with a 500, not a hang (the client's 10 s timeout would raise instead).
        r = await post(
            client,
            p,
            "/v1/chat/completions",
            {**body2, "max_tokens": 1, "kv_transfer_params": d1["kv_transfer_params"]},
        )
        assert r.status_code == 500
        assert r.json()["error"]["message"] == "Internal server error"
        metrics = await ascrape(client, p.url)
        assert metrics["vllm:nixl_num_kv_expired_reqs_total"] == 1
        # P stays healthy: the same request without the handle works.
        assert (await post(client, p, "/v1/chat/completions", body2)).status_code == 200


async def test_a_read_is_declined_only_within_the_configured_margin_of_the_deadline(
    client: httpx.AsyncClient,
) -> None:
    # A benchmark that scales D's TTL scales P's 5 s margin with it; here 1 s of 480.
    async with pd_pair(p_enable_prefix_caching=False, expiry_margin=1.0) as (p, d):
        first = [user(LONG * 2)]
        d1, _ = await pd_chat(client, p, d, chat_body(first))
        await post(client, d, "/sim/faults", {"advance_clock": 476})  # past 480 - 5, not 480 - 1
        body2 = chat_body(turn2_messages(first, d1["choices"][0]["message"]["content"]))
        params = {**body2, "max_tokens": 1, "kv_transfer_params": d1["kv_transfer_params"]}
        assert (await post(client, p, "/v1/chat/completions", params)).status_code == 200
        metrics = await ascrape(client, p.url)
        assert metrics.get("vllm:nixl_num_kv_expired_reqs_total", 0) == 0
        pulled = metrics["vllm:prompt_tokens_by_source_total{source=external_kv_transfer}"]
        assert pulled == d1["kv_transfer_params"]["remote_num_tokens"]


async def test_pinned_blocks_are_released_after_the_ttl(client: httpx.AsyncClient) -> None:
    async with pd_pair() as (p, d):
        await pd_chat(client, p, d, chat_body([user(LONG)]))

        async def held() -> list[str]:
            held: list[str] = (await client.get(d.url + "/sim/state")).json()["held_requests"]
            return held

        assert await held()
        await post(client, d, "/sim/faults", {"advance_clock": 400})
        assert await held()  # not before the TTL
        await post(client, d, "/sim/faults", {"advance_clock": 80})
        await eventually(held, lambda h: h == [], what="D releases the pin at its TTL")


async def test_handle_used_twice_is_read_again_and_goes_wrong_after_reuse(
    client: httpx.AsyncClient, ref: SimServer
) -> None:
    async with pd_pair(p_enable_prefix_caching=False, d_num_blocks=60, threshold=0) as (p, d):
        first = [user(LONG * 3)]
        d1, _ = await pd_chat(client, p, d, chat_body(first))
        handle = d1["kv_transfer_params"]
        body2 = chat_body(turn2_messages(first, d1["choices"][0]["message"]["content"]))
        d2, _ = await pd_chat(client, p, d, body2, handle)
        assert output_ids(d2) == await reference(client, ref, body2)
        # Churn D so the freed blocks are reused, then send the same handle again.
        for i in range(12):
            await post(
                client, d, "/v1/chat/completions", chat_body([user(f"other {i} " + LONG * 4)], 20)
            )
        again, _ = await pd_chat(client, p, d, body2, handle)
        assert output_ids(again) != output_ids(d2)
        assert (await ascrape(client, d.url))["vllm:nixl_num_notifications_after_expiry_total"] >= 1


async def test_restarted_decode_makes_old_handles_fail(client: httpx.AsyncClient) -> None:
    async with pd_pair(p_enable_prefix_caching=False) as (p, d):
        first = [user(LONG * 2)]
        d1, _ = await pd_chat(client, p, d, chat_body(first))
        old_engine = d.engine.engine_id
        new = (await post(client, d, "/sim/faults", {"restart": True})).json()
        assert new["engine_id"] != old_engine
        body2 = chat_body(turn2_messages(first, d1["choices"][0]["message"]["content"]))
        r = await post(
            client,
            p,
            "/v1/chat/completions",
            {**body2, "max_tokens": 1, "kv_transfer_params": d1["kv_transfer_params"]},
        )
        assert r.status_code == 500
        assert (await ascrape(client, p.url))["vllm:nixl_num_failed_transfers_total"] == 1


async def test_recompute_policy_hangs_on_p_but_recovers_on_d(
    client: httpx.AsyncClient, ref: SimServer
) -> None:
    async with pd_pair(policy="recompute", p_enable_prefix_caching=False) as (p, d):
        first = [user(LONG * 2)]
        d1, _ = await pd_chat(client, p, d, chat_body(first))
        await post(client, d, "/sim/faults", {"restart": True})
        body2 = chat_body(turn2_messages(first, d1["choices"][0]["message"]["content"]))
        with pytest.raises(
            httpx.ReadTimeout
        ):  # as vLLM 0.32 does: the router's timeout is the only way out
            await client.post(
                p.url + "/v1/chat/completions",
                json={**body2, "max_tokens": 1, "kv_transfer_params": d1["kv_transfer_params"]},
                timeout=0.5,
            )
        # D with policy recompute and P params naming a dead engine: recomputes, answers right.
        stale = {**d1["kv_transfer_params"], "do_remote_prefill": True, "do_remote_decode": False}
        r = await post(client, d, "/v1/chat/completions", {**body2, "kv_transfer_params": stale})
        assert r.status_code == 200 and output_ids(r.json()) == await reference(client, ref, body2)


async def test_fail_policy_on_d_returns_500(client: httpx.AsyncClient) -> None:
    async with pd_pair() as (p, d):
        bogus = {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_block_ids": [[1, 2]],
            "remote_engine_id": "no-such-engine",
            "remote_request_id": "x",
            "remote_host": "127.0.0.1",
            "remote_port": p.config.side_channel_port,
            "tp_size": 1,
            "remote_num_tokens": 20,
        }
        r = await post(
            client, d, "/v1/chat/completions", chat_body([user(LONG)], kv_transfer_params=bogus)
        )
        assert r.status_code == 500


async def test_d_alone_returns_a_handle_that_p_can_use(
    client: httpx.AsyncClient, ref: SimServer
) -> None:
    async with pd_pair(p_enable_prefix_caching=False) as (p, d):
        first = [user(LONG * 3)]
        r1 = await post(
            client,
            d,
            "/v1/chat/completions",
            chat_body(first, kv_transfer_params={"do_remote_prefill": False}),
        )
        d1 = r1.json()
        assert d1["kv_transfer_params"]["do_remote_decode"] is True
        none = await post(client, d, "/v1/chat/completions", chat_body(first))
        assert none.json()["kv_transfer_params"] is None
        body2 = chat_body(turn2_messages(first, d1["choices"][0]["message"]["content"]))
        d2, p2 = await pd_chat(client, p, d, body2, d1["kv_transfer_params"])
        assert p2["kv_transfer_params"]["remote_prefill_cached_tokens"] > 0
        assert output_ids(d2) == await reference(client, ref, body2)


async def _stream_chunks(client: httpx.AsyncClient, url: str, body: dict[str, Any]) -> list[Any]:
    import json

    chunks: list[Any] = []
    async with client.stream("POST", url, json={**body, "stream": True}) as r:
        async for line in r.aiter_lines():
            if line.startswith("data: "):
                data = line[6:]
                chunks.append(data if data == "[DONE]" else json.loads(data))
    return chunks


@pytest.mark.parametrize("version", ["0.33.0", "0.32.0"])
async def test_streamed_finish_chunk_carries_the_handle_from_033(
    client: httpx.AsyncClient, version: str
) -> None:
    async with pd_pair(d_vllm_version=version) as (p, d):
        body = chat_body([user(LONG)], stream_options={"include_usage": True})
        rp = (
            await post(
                client,
                p,
                "/v1/chat/completions",
                {**body, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}},
            )
        ).json()
        chunks = await _stream_chunks(
            client,
            d.url + "/v1/chat/completions",
            {**body, "kv_transfer_params": rp["kv_transfer_params"]},
        )
        assert chunks[-1] == "[DONE]"
        assert chunks[0]["prompt_token_ids"]
        finish = next(c for c in chunks[:-1] if c["choices"] and c["choices"][0]["finish_reason"])
        usage = chunks[-2]
        assert usage["choices"] == [] and "kv_transfer_params" not in usage
        held = (await client.get(d.url + "/sim/state")).json()["held_requests"]
        if version == "0.33.0":
            assert finish["kv_transfer_params"]["remote_request_id"] in held
        else:
            assert "kv_transfer_params" not in finish
            assert len(held) == 1  # pinned for the TTL all the same
        ids = [
            i for c in chunks[1:-1] if c["choices"] for i in c["choices"][0].get("token_ids", [])
        ]
        assert len(ids) == usage["usage"]["completion_tokens"]


async def test_stop_string_returns_no_handle_and_frees_blocks(client: httpx.AsyncClient) -> None:
    async with pd_pair() as (p, d):
        body = chat_body([user(LONG)], 60)
        d1, _ = await pd_chat(client, p, d, body)
        text = d1["choices"][0]["message"]["content"]
        stop_word = text.split()[3]
        await post(client, d, "/sim/faults", {"evict_pinned": True})
        d2, _ = await pd_chat(client, p, d, {**body, "stop": [stop_word]})
        assert (
            d2["choices"][0]["finish_reason"] == "stop"
            and d2["choices"][0]["stop_reason"] == stop_word
        )
        assert d2["kv_transfer_params"] is None
        assert (await client.get(d.url + "/sim/state")).json()["held_requests"] == []


async def test_answers_survive_a_round_trip_unless_noncanonical(client: httpx.AsyncClient) -> None:
    for noncanonical in (False, True):
        async with running(sim_config(None, noncanonical_outputs=noncanonical)) as server:
            first = [user(LONG)]
            r = (await post(client, server, "/v1/chat/completions", chat_body(first))).json()
            answer = r["choices"][0]["message"]["content"]
            n2 = await tokenize(client, server, turn2_messages(first, answer))
            s_d = r["prompt_token_ids"] + output_ids(r)
            assert (n2[: len(s_d)] == s_d) is not noncanonical


async def test_bad_requests_get_openai_errors(client: httpx.AsyncClient) -> None:
    async with running(sim_config(None)) as server:
        for body, status in [
            (chat_body([user("hi")], temperature=0.7), 400),
            ({**chat_body([user("hi")]), "model": "other"}, 404),
            (chat_body([user("hi")], 10**9), 400),
            (chat_body([user("hi")], kv_transfer_params={"prompt_token_ids": [-1]}), 400),
            ({"model": MODEL, "messages": []}, 400),
        ]:
            r = await post(client, server, "/v1/chat/completions", body)
            assert r.status_code == status and r.json()["error"]["code"] == status


async def test_prompt_token_ids_in_params_replace_rendering(client: httpx.AsyncClient) -> None:
    async with running(sim_config(None)) as server:
        ids = await tokenize(client, server, [user("first text " * 10)])
        body = chat_body(
            [user("completely different")], kv_transfer_params={"prompt_token_ids": ids}
        )
        r = (await post(client, server, "/v1/chat/completions", body)).json()
        assert r["prompt_token_ids"] == ids


async def test_metrics_and_surface(client: httpx.AsyncClient) -> None:
    async with pd_pair() as (p, d):
        await pd_chat(client, p, d, chat_body([user(LONG)]))
        metrics = await ascrape(client, d.url)
        assert metrics["vllm:kv_cache_usage_perc"] > 0
        assert metrics["vllm:request_success_total{finished_reason=stop}"] == 1
        assert (await client.get(p.url + "/version")).json()["version"] == "0.33.0"
        assert (await client.get(p.url + "/v1/models")).json()["data"][0]["id"] == MODEL
        assert (await client.get(p.url + "/health")).status_code == 200
        rendered = (
            await post(client, p, "/v1/chat/completions/render", chat_body([user("hi")]))
        ).json()
        assert rendered["token_ids"] == await tokenize(client, p, [user("hi")])


async def test_prefill_without_bidirectional_flag_hangs_on_a_decode_handle(
    client: httpx.AsyncClient,
) -> None:
    # Unverified in vLLM, inferred from pull_scheduler.py (docs/vllm-protocol.md §4): a P without
    # bidirectional_kv_xfer still reports the external tokens but never registers the receive,
    # so the request waits in WAITING_FOR_REMOTE_KVS. The simulator hangs the same way.
    async with pd_pair(p_bidirectional=False) as (p, d):
        d1, _ = await pd_chat(client, p, d, chat_body([user(LONG)]))
        assert d1["kv_transfer_params"]["do_remote_decode"] is True  # D still pins and returns one
        with pytest.raises(httpx.ReadTimeout):
            await client.post(
                p.url + "/v1/chat/completions",
                json={
                    **chat_body([user(LONG), {"role": "assistant", "content": "x"}, user("y")]),
                    "max_tokens": 1,
                    "kv_transfer_params": d1["kv_transfer_params"],
                },
                timeout=0.5,
            )


def test_one_wrong_block_among_loaded_ones_changes_the_answer() -> None:
    """Loaded blocks are copied, not chained: a wrong interior block leaves the last one as
    computing would, and the fingerprint the answer comes from still differs."""
    tokens = list(range(100, 180))  # five blocks of 16
    right = BlockPool(8, 16)
    computed = right.allocate(5)
    right.compute(computed, tokens, 0, len(tokens))
    loaded = BlockPool(8, 16)
    copied = loaded.allocate(5)
    for mine, theirs in zip(copied, computed, strict=True):
        loaded.content[mine] = right.content[theirs]
    assert loaded.fingerprint(copied, len(tokens)) == right.fingerprint(computed, len(tokens))
    loaded.content[copied[2]] = chain(SEED, tokens[:16])  # a block computed for other tokens
    assert loaded.content[copied[-1]] == right.content[computed[-1]]
    assert loaded.fingerprint(copied, len(tokens)) != right.fingerprint(computed, len(tokens))


async def test_a_read_waiting_for_blocks_on_d_renews_p_s_lease(
    client: httpx.AsyncClient, ref: SimServer
) -> None:
    """D renews P's lease while a request waits there to read P's blocks (vLLM's heartbeats,
    docs/vllm-protocol.md §4): a read long after the lease would have ended gets what P
    computed, and P counts no read after expiry."""
    lease = 9.0  # D's heartbeats go out every lease // 6 = 1 s
    async with pd_pair(lease=lease, d_num_blocks=16) as (p, d):
        await pd_chat(client, p, d, chat_body([user(LONG * 3)]))  # D's pin fills most of it
        body = chat_body([user("other " + LONG * 3)])
        rp = await post(
            client,
            p,
            "/v1/chat/completions",
            {**body, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}},
        )
        params = rp.json()["kv_transfer_params"]
        lease_id = params["remote_request_id"]
        read = asyncio.create_task(
            post(client, d, "/v1/chat/completions", {**body, "kv_transfer_params": params})
        )

        async def state(server: SimServer) -> dict[str, Any]:
            got: dict[str, Any] = (await client.get(server.url + "/sim/state")).json()
            return got

        await eventually(
            lambda: state(d), lambda s: lease_id in s["renewing"], what="D waits for blocks"
        )
        # Three times half a lease on P's clock, each right after a heartbeat (so a late one
        # still has seconds to arrive): past the lease's end, unless D renews it.
        for _ in range(3):
            await eventually(
                lambda: state(p),
                lambda s: s["leases"].get(lease_id, 0) > lease - 1,
                what="D's heartbeat renews P's lease",
            )
            await post(client, p, "/sim/faults", {"advance_clock": lease / 2})
        await eventually(
            lambda: state(p),
            lambda s: s["leases"].get(lease_id, 0) > lease - 1,
            what="D's heartbeat renews P's lease past its first end",
        )
        await post(client, d, "/sim/faults", {"advance_clock": 480})  # the pin ends: room
        answer = await asyncio.wait_for(read, 10)
        assert answer.status_code == 200
        assert output_ids(answer.json()) == await reference(client, ref, body)
        assert (await state(p))["leases"] == {}
        assert (await ascrape(client, p.url))["vllm:nixl_num_notifications_after_expiry_total"] == 0
