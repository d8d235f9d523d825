"""Routing by where the KV is: the router's index of every engine's KV events sends a turn to
the P and the D that already hold its prefix (docs/kv-events.md)."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

from bench.sim.server import SimServer
from tests.support.metrics import ascrape
from tests.support.stack import Stack, chat_turn, stack
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
        name_of(sim): values.get(f"carryover_kv_index_blocks{{instance={name_of(sim)}}}", 0.0)
        for sim in (*s.prefill, *s.decode)
    }


async def new_conversation(s: Stack, question: str) -> None:
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": question},
    ]
    got = await chat_turn(s.client, s.router.url, messages, conversation_id=uuid.uuid4().hex)
    assert got.status == 200 and got.path == "cold-miss", got.raw


async def test_new_conversations_go_where_their_shared_prefix_is_cached(tmp_path: Path) -> None:
    async with stack(
        tmp_path,
        prefills=2,
        decodes=2,
        sim={"kv_events": True, "threshold": 16},
        router_flags=("--expose-path-header",),
    ) as s:
        await new_conversation(s, "What is the size of /etc/hosts?")
        # The index learns, from the engines' events, which P and which D hold the prompt.
        learned = await eventually(
            lambda: index_blocks(s),
            lambda blocks: all(
                any(blocks[name_of(sim)] > 0 for sim in group) for group in (s.prefill, s.decode)
            ),
            what="the index holds the first conversation's blocks",
        )
        p_holder = next(p for p in s.prefill if learned[name_of(p)] > 0)
        d_holder = next(d for d in s.decode if learned[name_of(d)] > 0)
        p_other = next(p for p in s.prefill if p is not p_holder)
        d_other = next(d for d in s.decode if d is not d_holder)
        sims = (*s.prefill, *s.decode)
        hits_before = {sim.url: await local_hits(s, sim) for sim in sims}
        for i in range(4):
            await new_conversation(s, f"And the size of /var/log/syslog.{i}?")
        hits = {sim.url: await local_hits(s, sim) - hits_before[sim.url] for sim in sims}
        shared = len(SYSTEM) // 8  # well under the system prompt's tokens, in whole blocks
        # Every new conversation's P and D already held the shared prefix: they computed only
        # the rest, and the other instances saw none of these turns' prefixes.
        assert hits[p_holder.url] >= 4 * shared, hits
        assert hits[d_holder.url] >= 4 * shared, hits
        assert hits[p_other.url] == 0 and hits[d_other.url] == 0, hits
        router = await ascrape(s.client, s.router.url)
        assert router["carryover_kv_cached_tokens_total{leg=prefill}"] >= 4 * shared
