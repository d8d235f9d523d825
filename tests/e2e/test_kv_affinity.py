"""Routing by where the KV is: the router's index of every engine's KV events sends a turn to
the P and the D that already hold its prefix (docs/kv-events.md)."""

from __future__ import annotations

import json
import uuid
from pathlib import Path
from typing import Any

from carryover.bench.sim.server import SimServer
from tests.support.metrics import ascrape, turns_by_path
from tests.support.stack import Stack, chat_turn, first_turn, held_by, reference_chat, stack
from tests.support.waiting import eventually

# A long shared system prompt (a tool list, say): many blocks of 16 tokens.
SYSTEM = " ".join(f"tool-{i} takes a path and returns its size in bytes." for i in range(60))


def name_of(sim: SimServer) -> str:
    return sim.url.removeprefix("http://")


async def local_hits(s: Stack, sim: SimServer) -> float:
    values = await ascrape(s.client, sim.url)
    return values.get("vllm:prompt_tokens_by_source_total{source=local_cache_hit}", 0.0)


async def index_blocks(s: Stack) -> dict[str, float]:
    values = await ascrape(s.client, s.router.url)
    return {
        name_of(sim): values.get(f"carryover_kv_index_blocks{{server={name_of(sim)}}}", 0.0)
        for sim in (*s.prefill, *s.decode)
    }


async def shared_prefix_turn(s: Stack, question: str, conversation: str | None = None) -> None:
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": question},
    ]
    got = await chat_turn(s.client, s.router.url, messages, conversation_id=conversation)
    path = "cold-miss" if conversation is not None else "no-conversation"
    assert got.status == 200 and got.path == path, got.raw


async def test_prompts_go_where_their_shared_prefix_is_cached_and_conversations_spread(
    tmp_path: Path,
) -> None:
    async with stack(
        tmp_path,
        prefills=2,
        decodes=2,
        sim={"kv_events": True, "threshold": 16},
        router_flags=("--expose-path-header",),
    ) as s:
        await shared_prefix_turn(s, "What is the size of /etc/hosts?")
        # The index learns, from the engines' events, which P and which D hold the prompt.
        learned = await eventually(
            lambda: index_blocks(s),
            lambda blocks: all(
                any(blocks[name_of(sim)] > 0 for sim in group) for group in (s.prefill, s.decode)
            ),
            what="the index holds the first prompt's blocks",
        )
        p_holder = next(p for p in s.prefill if learned[name_of(p)] > 0)
        d_holder = next(d for d in s.decode if learned[name_of(d)] > 0)
        p_other = next(p for p in s.prefill if p is not p_holder)
        d_other = next(d for d in s.decode if d is not d_holder)
        sims = (*s.prefill, *s.decode)
        hits_before = {sim.url: await local_hits(s, sim) for sim in sims}
        for i in range(4):
            await shared_prefix_turn(s, f"And the size of /var/log/syslog.{i}?")
        hits = {sim.url: await local_hits(s, sim) - hits_before[sim.url] for sim in sims}
        shared = len(SYSTEM) // 8  # well under the system prompt's tokens, in whole blocks
        # Every prompt's P and D already held the shared prefix: they computed only the rest,
        # and the other instances saw none of these prompts.
        assert hits[p_holder.url] >= 4 * shared, hits
        assert hits[d_holder.url] >= 4 * shared, hits
        assert hits[p_other.url] == 0 and hits[d_other.url] == 0, hits
        router = await ascrape(s.client, s.router.url)
        assert router["carryover_kv_cached_tokens_total{leg=prefill}"] >= 4 * shared
        # Each turn's log line names where it ran and what the index said the P held: the
        # most any P held.
        lines = [json.loads(line) for line in s.router.log().splitlines() if '"turn"' in line]
        later = [line for line in lines if line.get("msg") == "turn"][1:]
        assert len(later) == 4
        for line in later:
            assert line["prefill"] == name_of(p_holder) and line["decode"] == name_of(d_holder)
            assert line["prefill_indexed_tokens"] == line["prefill_most_indexed_tokens"] >= shared
        # A conversation's first turn goes to the P its id hashes to, holder or not: its later
        # turns follow its history there, and the holder of a shared system prompt would
        # become every conversation's P (router/fleet/policy.py). Sixteen conversations all
        # hashing to one of two Ps: one run in 30,000.
        for i in range(16):
            await shared_prefix_turn(s, f"Where is /etc/motd.{i}?", conversation=f"c{i}")
        lines = [json.loads(line) for line in s.router.log().splitlines() if '"turn"' in line]
        firsts = [line for line in lines if line.get("msg") == "turn"][5:]
        assert {line["prefill"] for line in firsts} == {name_of(p) for p in s.prefill}


async def test_a_short_turn_on_the_decode_that_holds_its_history_skips_p(tmp_path: Path) -> None:
    async with stack(
        tmp_path,
        sim={"kv_events": True, "threshold": 16},
        router_flags=("--expose-path-header", "--decode-local-max-tokens", "256"),
    ) as s:
        (p,), (d,) = s.prefill, s.decode
        conversation, messages = await first_turn(
            s, SYSTEM, "Now only the size of /etc/hosts, please."
        )
        await eventually(
            lambda: index_blocks(s),
            lambda blocks: blocks[name_of(d)] >= len(SYSTEM) // 8 // 16,
            what="the index holds D's blocks of the first turn",
        )
        held_before = await held_by(s)
        p_before, d_before = await ascrape(s.client, p.url), await local_hits(s, d)
        paths_before = await turns_by_path(s.client, s.router.url)
        got = await chat_turn(s.client, s.router.url, messages, conversation_id=conversation)
        assert got.status == 200 and got.path == "decode-local", got.raw
        paths = await turns_by_path(s.client, s.router.url) - paths_before
        assert paths == {"decode-local": 1}  # counted as the client was told, not as reuse
        assert got.content == (await reference_chat(s, messages)).content
        # D served the history from its own cache; P computed nothing for this turn (one
        # token at most: the release of the previous handle, which is a P request).
        hits = await local_hits(s, d) - d_before
        assert hits >= len(SYSTEM) // 8
        assert got.usage["prompt_tokens_details"]["cached_tokens"] == hits  # D's own, here
        p_after = await ascrape(s.client, p.url)
        computed = "vllm:prompt_tokens_by_source_total{source=local_compute}"
        assert p_after[computed] - p_before[computed] <= 1
        # The unneeded handle of turn 1 was released once D answered.
        await eventually(
            lambda: held_by(s),
            lambda held: not set(held_before) & set(held),
            what="turn 1's pin is released",
        )


async def test_a_handle_that_adds_a_few_tokens_to_ps_own_cache_is_given_back(
    tmp_path: Path,
) -> None:
    """A pull has a fixed cost; a handle that saves only the last answer's few tokens over
    what P's own cache holds is given back (D frees its blocks) and P computes them."""
    async with stack(
        tmp_path,
        sim={"kv_events": True, "threshold": 1},
        router_flags=("--expose-path-header",),
    ) as s:
        (p,) = s.prefill
        conversation = uuid.uuid4().hex
        messages: list[dict[str, Any]] = [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": "Only say yes."},
        ]
        got = await chat_turn(
            s.client, s.router.url, messages, conversation_id=conversation, max_tokens=4
        )
        assert got.status == 200 and got.path == "cold-miss", got.raw
        messages += [
            {"role": "assistant", "content": got.content},
            {"role": "user", "content": "Again."},
        ]
        await eventually(
            lambda: index_blocks(s),
            lambda blocks: blocks[name_of(p)] >= len(SYSTEM) // 8 // 16,
            what="the index holds P's blocks of the first turn",
        )
        held_before = await held_by(s)
        assert held_before  # D pins turn 1 for the next turn
        p_before = await ascrape(s.client, p.url)
        released_before = (await ascrape(s.client, s.router.url)).get(
            "carryover_handles_released_total{cause=pull_does_not_pay}", 0.0
        )
        got = await chat_turn(
            s.client, s.router.url, messages, conversation_id=conversation, max_tokens=4
        )
        assert got.status == 200 and got.path == "prefill-cache", got.raw
        assert got.content == (await reference_chat(s, messages, max_tokens=4)).content
        p_after = await ascrape(s.client, p.url)
        pulled = "vllm:prompt_tokens_by_source_total{source=external_kv_transfer}"
        computed = "vllm:prompt_tokens_by_source_total{source=local_compute}"
        # P pulled nothing (its sim pulls anything of 1 token or more when asked) and computed
        # only what its own cache lacked: turn 1's answer and the new message.
        assert p_after.get(pulled, 0.0) == p_before.get(pulled, 0.0)
        assert 0 < p_after[computed] - p_before[computed] < 40
        router = await ascrape(s.client, s.router.url)
        assert router["carryover_handles_released_total{cause=pull_does_not_pay}"] == (
            released_before + 1
        )
        await eventually(
            lambda: held_by(s),
            lambda held: not set(held_before) & set(held),
            what="turn 1's pin is freed",
        )


async def test_a_decode_local_turn_with_no_healthy_decode_settles_its_claimed_handle(
    tmp_path: Path,
) -> None:
    """Decode-local picks D before any leg: with none healthy the turn is a 503, and the
    record it claimed has its one fate (released: never sent), none left open."""
    async with stack(
        tmp_path,
        sim={"kv_events": True, "threshold": 16},
        router_flags=("--expose-path-header", "--decode-local-max-tokens", "256"),
    ) as s:
        (d,) = s.decode
        conversation, messages = await first_turn(
            s, SYSTEM, "Now only the size of /etc/hosts, please."
        )
        released = "carryover_handle_fates_total{cause=turn_failed,fate=released}"
        before = await ascrape(s.client, s.router.url)
        await d.stop()
        up = f"carryover_instance_up{{role=decode,server={name_of(d)}}}"
        await eventually(
            lambda: ascrape(s.client, s.router.url),
            lambda values: values.get(up) == 0.0,
            what="the router sees D down",
        )
        got = await chat_turn(s.client, s.router.url, messages, conversation_id=conversation)
        assert got.status == 503, got.raw
        after = await eventually(
            lambda: ascrape(s.client, s.router.url),
            lambda values: values.get("carryover_handles_open") == 0.0,
            what="no handle left without a fate",
        )
        assert after.get(released, 0.0) - before.get(released, 0.0) == 1
        assert after["carryover_handle_ledger_errors_total"] == 0
