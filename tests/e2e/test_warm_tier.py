"""A warm tier behind D's TTL (docs/warm-tier.md): every P saves what it computed to a shared
tier (a simulated LMCache server); a turn whose handle is gone loads its history from there
(path ``warm``), and runs cold, counted and without an error, while the tier is down."""

from __future__ import annotations

from pathlib import Path

from carryover.bench.sim.warm_tier import SimWarmTier
from tests.support.metrics import ascrape, turns_by_path
from tests.support.secrets import admin_key_flags
from tests.support.stack import Stack, chat_turn, first_turn, reference_chat, stack
from tests.support.waiting import eventually

CHUNK = 64
SYSTEM = " ".join(f"Rule {i}: answer in full sentences and cite the page." for i in range(30))
LOADED = "vllm:prompt_tokens_by_source_total{source=external_kv_transfer}"
COMPUTED = "vllm:prompt_tokens_by_source_total{source=local_compute}"
ADMIN = {"Authorization": "Bearer adm"}


async def p_sources(s: Stack) -> tuple[float, float]:
    """Tokens every P loaded and computed so far (the engines' own counters)."""
    loaded = computed = 0.0
    for p in s.prefill:
        values = await ascrape(s.client, p.url)
        loaded += values.get(LOADED, 0.0)
        computed += values.get(COMPUTED, 0.0)
    return loaded, computed


async def record_expired(s: Stack, conversation: str) -> None:
    """The router's record of the conversation (and with it D's handle) is gone, as after a
    reader's pause longer than D's TTL."""
    await eventually(
        lambda: s.client.get(f"{s.router.url}/admin/conversations/{conversation}", headers=ADMIN),
        lambda r: r.status_code == 404,
        what="the store drops the record at its expiry",
    )


async def test_a_turn_without_its_handle_loads_its_history_from_the_warm_tier(
    tmp_path: Path,
) -> None:
    tier = SimWarmTier(chunk_tokens=CHUNK)
    await tier.start()
    flags = (
        "--expose-path-header",
        *admin_key_flags(tmp_path, "adm"),
        # Records live half a second (D's 6 s less vLLM's 5 s margin and the queue's 0.5 s).
        *("--decoder-kv-blocks-ttl", "6", "--queue-margin", "0.5"),
        *("--warm-tier", "lmcache", "--warm-tier-health", tier.health),
        *("--warm-tier-chunk-tokens", str(CHUNK)),
    )
    try:
        async with stack(
            tmp_path,
            prefills=2,
            router_flags=flags,
            sim={"threshold": 16},
            # P keeps no prefix cache (as under load, it evicted the history): what P does
            # not compute, it loaded from the tier.
            p_sim={"enable_prefix_caching": False},
            warm_tier=tier,
        ) as s:
            conversation, messages = await first_turn(s, SYSTEM, "Where is chapter two?")
            assert tier.stored_tokens >= 4 * CHUNK
            await record_expired(s, conversation)
            loaded_before, computed_before = await p_sources(s)
            paths_before = await turns_by_path(s.client, s.router.url)
            got = await chat_turn(s.client, s.router.url, messages, conversation_id=conversation)
            assert got.status == 200 and got.path == "warm", got.raw
            # Counted once, as the client was told: not as the cold-miss it was planned as.
            assert await turns_by_path(s.client, s.router.url) - paths_before == {"warm": 1}
            assert got.content == (await reference_chat(s, messages)).content
            loaded_after, computed_after = await p_sources(s)
            loaded = loaded_after - loaded_before
            # The history's whole chunks came from the tier; P computed only the rest.
            assert loaded >= 4 * CHUNK and loaded % CHUNK == 0
            prompt = got.usage["prompt_tokens"]
            assert computed_after - computed_before == prompt - loaded
            router = await ascrape(s.client, s.router.url)
            assert router["carryover_warm_tier_turns_total{outcome=hit,tier=lmcache}"] == 1
            # What the router expected from the tier is what P loaded.
            assert router["carryover_warm_tier_tokens_total{tier=lmcache}"] == loaded

            # An edited history: the tier keys chunks by their tokens, so P loads only the
            # chunks before the edit, and the answer is still the reference's.
            edited = [dict(m) for m in messages]
            edited[0]["content"] = SYSTEM.replace("Rule 20:", "Rule twenty:")
            await record_expired(s, conversation)
            before = await p_sources(s)
            got_edited = await chat_turn(
                s.client, s.router.url, edited, conversation_id=conversation
            )
            assert got_edited.status == 200 and got_edited.path == "warm", got_edited.raw
            assert got_edited.content == (await reference_chat(s, edited)).content
            loaded_edited = (await p_sources(s))[0] - before[0]
            assert 0 < loaded_edited < loaded and loaded_edited % CHUNK == 0

            # The tier fails its health check: the next such turn runs cold, and is counted.
            tier.up = False
            await eventually(
                lambda: ascrape(s.client, s.router.url),
                lambda m: m.get("carryover_warm_tier_up{tier=lmcache}") == 0,
                what="the router sees the tier down",
            )
            messages += [
                {"role": "assistant", "content": got.content},
                {"role": "user", "content": "And chapter three?"},
            ]
            await record_expired(s, conversation)
            loaded_before, _ = await p_sources(s)
            got = await chat_turn(s.client, s.router.url, messages, conversation_id=conversation)
            assert got.status == 200 and got.path == "cold-miss", got.raw
            assert got.content == (await reference_chat(s, messages)).content
            assert (await p_sources(s))[0] == loaded_before
            router = await ascrape(s.client, s.router.url)
            assert router["carryover_warm_tier_turns_total{outcome=down,tier=lmcache}"] == 1
    finally:
        await tier.stop()
