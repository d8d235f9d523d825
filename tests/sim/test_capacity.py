"""The simulator's KV capacity behaves as vLLM's does where the fleet benchmark depends on it
(issue 39): blocks held by a request or a pin count against capacity and are never evicted;
a request that finds no free block waits, and a running one that finds none preempts the one
admitted last (vLLM's recompute preemption); cached blocks no one holds are evicted least
recently freed first, and each eviction is a KV event; a pull costs time by bytes, so a
small one can lose to computing the tokens locally."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from carryover.bench.sim.kv import BlockPool, OutOfBlocks, token_hashes
from carryover.bench.sim.kv_wire import Removed
from carryover.bench.sim.sequence import EngineSequence, Finished, GenerationRequest
from carryover.bench.sim.timing import Timing
from tests.sim.helpers import chat_body, user
from tests.support.metrics import ascrape
from tests.support.sims import running, sim_config


def _prompt(start: int, blocks: int, size: int = 4) -> list[int]:
    return list(range(start, start + blocks * size))


async def _finishing_order(*sequences: EngineSequence, timeout: float) -> list[str]:
    """The request ids of ``sequences`` in the order they finish (all must, within
    ``timeout``)."""
    order: list[str] = []

    async def finished(seq: EngineSequence) -> None:
        while not isinstance(await seq.events.get(), Finished):
            pass
        order.append(seq.request.request_id)

    await asyncio.wait_for(asyncio.gather(*(finished(s) for s in sequences)), timeout=timeout)
    return order


def test_held_blocks_count_against_capacity_and_a_request_beyond_it_waits() -> None:
    pool = BlockPool(8, 4)
    held = pool.allocate(6)  # a running request, or D's pin of a finished turn
    assert pool.usage() == pytest.approx(6 / 8)
    with pytest.raises(OutOfBlocks):
        pool.allocate(3)  # the engine leaves it waiting for blocks (engine.py)
    pool.release(held[:2])
    assert len(pool.allocate(3)) == 3


def test_cached_free_blocks_go_least_recently_freed_first_with_an_event_each() -> None:
    pool = BlockPool(4, 4, events=True)
    old, new = _prompt(0, 2), _prompt(100, 2)
    first = pool.allocate(2)
    pool.cache(first, old)
    pool.release(first)  # freed first: evicted first
    second = pool.allocate(2)
    pool.cache(second, new)
    pool.release(second)
    pool.take_events()
    assert pool.cached_blocks == 4
    pool.allocate(2)  # needs two blocks: both of the older prompt's go
    removed = [e for e in pool.take_events() if isinstance(e, Removed)]
    gone = {h for e in removed for h in e.block_hashes}
    assert gone == set(token_hashes(old, 4)) and len(removed) == 2
    assert len(pool.lookup(token_hashes(new, 4), 2)) == 2  # the newer one is still cached
    assert pool.lookup(token_hashes(old, 4), 2) == []


def test_a_held_block_is_never_evicted() -> None:
    pool = BlockPool(4, 4)
    pinned = pool.allocate(2)
    pool.cache(pinned, _prompt(0, 2))
    with pytest.raises(OutOfBlocks):
        pool.allocate(3)
    assert len(pool.lookup(token_hashes(_prompt(0, 2), 4), 2)) == 2


def test_a_pull_costs_time_by_bytes_and_a_small_one_can_lose_to_computing() -> None:
    timing = Timing()
    assert timing.transfer(2000) - timing.transfer(1000) == pytest.approx(
        1000 * timing.kv_bytes_per_token / timing.kv_bandwidth
    )
    slow_link = Timing(kv_bandwidth=1e9)
    assert slow_link.transfer(1000) > timing.transfer(1000)
    # A few tokens: the transfer's fixed cost exceeds computing them on P.
    assert timing.transfer(16) > timing.prefill(16, 0) - timing.prefill_fixed
    # Thousands of tokens of history: pulling them is far cheaper than computing them.
    assert timing.transfer(8000) < timing.prefill(8000, 0) / 5


async def test_requests_outgrowing_the_cache_preempt_one_another_and_all_finish() -> None:
    """Two requests admitted with room for their prompts, whose answers then need more blocks
    than the cache has: without preemption both wait for a block forever. As vLLM's scheduler
    does, the one admitted last gives its blocks back, waits, recomputes, and both answers are
    what each gets alone."""
    body = chat_body([user("Tell me about rivers.")], max_tokens=70, ignore_eos=True)
    async with (
        running(sim_config(None)) as alone,
        running(sim_config(None, num_blocks=10, speed=0.05)) as small,
        httpx.AsyncClient(timeout=10) as client,
    ):
        want = (await client.post(alone.url + "/v1/chat/completions", json=body)).json()
        first, second = await asyncio.wait_for(
            asyncio.gather(
                client.post(small.url + "/v1/chat/completions", json=body),
                client.post(
                    small.url + "/v1/chat/completions",
                    json={**body, "messages": [user("Tell me about stones.")]},
                ),
            ),
            timeout=10,
        )
        metrics = await ascrape(client, small.url)
    assert first.status_code == second.status_code == 200
    assert first.json()["choices"][0]["token_ids"] == want["choices"][0]["token_ids"]
    assert len(second.json()["choices"][0]["token_ids"]) == 70
    assert metrics["vllm:num_preemptions_total"] >= 1


async def test_a_request_holding_loaded_kv_runs_before_a_preempted_head_that_cannot() -> None:
    """The state a fleet run stopped in: a preempted request at the head of D's queue needs
    more blocks than are free, and a request behind it holds the blocks it loaded from P.
    As vLLM drains requests holding KV first, that one runs and frees its blocks, then the
    preempted one resumes: both finish (in queue order, neither would ever run)."""
    async with running(sim_config("kv_consumer", bidirectional=False, num_blocks=8)) as server:
        engine = server.engine
        eos = engine.template.eos_token_id
        blocked = EngineSequence(
            GenerationRequest("preempted", _prompt(0, 7, 16), max_tokens=4), "decode"
        )
        blocked.answer, blocked.preempted = [eos], True
        loaded = EngineSequence(
            GenerationRequest("loaded", _prompt(500, 2, 16), max_tokens=4), "decode"
        )
        loaded.blocks = engine.pool.allocate(2)
        loaded.computed = loaded.external = 32
        engine._waiting.extend([blocked, loaded])
        engine._wake.set()
        order = await _finishing_order(loaded, blocked, timeout=10)
    assert order == ["loaded", "preempted"]


async def test_no_load_takes_blocks_while_a_preempted_request_waits_for_them() -> None:
    """vLLM allocates blocks for a request's loaded KV when it reaches the head of the queue:
    not while a preempted request waits there, which would otherwise starve."""
    async with running(sim_config("kv_consumer", num_blocks=8)) as server:
        engine = server.engine
        blocked = EngineSequence(GenerationRequest("preempted", _prompt(0, 7, 16), 4), "decode")
        blocked.preempted = True
        engine._waiting.append(blocked)
        assert not engine._load_may_allocate()  # the gate _allocate waits on
        load = asyncio.create_task(engine._allocate(2))
        engine._waiting.remove(blocked)
        assert len(await asyncio.wait_for(load, timeout=10)) == 2
        assert engine._load_may_allocate()


async def test_a_lone_running_request_with_no_block_preempts_itself() -> None:
    """A request alone in the batch that needs a block for its next token, behind which a
    request holding loaded KV waits for one block more: vLLM's scheduler preempts the lone
    request too (``preempted_req == request``: "No more request to preempt"), so its blocks
    go to the waiting one, which finishes, and the preempted one resumes. Kept running, it
    and the waiting request wait on each other for good."""
    async with running(sim_config("kv_consumer", bidirectional=False, num_blocks=8)) as server:
        engine = server.engine
        eos = engine.template.eos_token_id
        lone = EngineSequence(GenerationRequest("lone", _prompt(0, 6, 16), max_tokens=4), "decode")
        lone.blocks = engine.pool.allocate(6)
        lone.computed = 96
        lone.answer = [100, 101, eos]
        loaded = EngineSequence(
            GenerationRequest("loaded", list(range(500, 540)), max_tokens=4), "decode"
        )
        loaded.blocks = engine.pool.allocate(2)  # 32 of its 40 prompt tokens, loaded
        loaded.computed = loaded.external = 32
        engine._running.append(lone)
        engine._waiting.append(loaded)
        engine._wake.set()
        order = await _finishing_order(loaded, lone, timeout=5)
        async with httpx.AsyncClient(timeout=5) as client:
            metrics = await ascrape(client, server.url)
    assert order == ["loaded", "lone"]
    assert lone.output == [100, 101, eos]  # its answer survives the recompute
    assert metrics["vllm:num_preemptions_total"] == 1
