"""The KV-event subscription over real ZMQ sockets on loopback, against a publisher that
speaks vLLM's protocol (frames, sequence numbers, replay): what arrives, what a gap, a
restart or a lost replay does to the index (router/kv/subscriber.py)."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import zmq.asyncio
from prometheus_client import CollectorRegistry

from carryover.bench.sim.kv_events import KvEventPublisher, KVEventsSettings
from carryover.bench.sim.kv_wire import Stored
from carryover.router.config import WarmTierConfig
from carryover.router.kv.index import InstanceBlocks, Prompt
from carryover.router.kv.metrics import KvMetrics
from carryover.router.kv.subscriber import EventSubscriber
from carryover.router.kv.warm import WarmTier
from tests.support.ports import free_port
from tests.support.waiting import eventually

SIZE = 4
_tokens = itertools.count(1)


def new_block() -> tuple[list[int], Stored]:
    """A one-block sequence of fresh tokens and the event that stores it."""
    ids = [next(_tokens) for _ in range(SIZE)]
    return ids, Stored([ids[0]], None, ids, SIZE, None, "GPU", None)


def holds(blocks: InstanceBlocks, ids: list[int]) -> bool:
    return blocks.cached(Prompt(ids).keys(SIZE)).tokens == SIZE


@asynccontextmanager
async def pair(
    *, replay: bool = True, warm: WarmTier | None = None
) -> AsyncIterator[tuple[KvEventPublisher, EventSubscriber]]:
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    replay_endpoint = f"tcp://127.0.0.1:{free_port()}"
    publisher = KvEventPublisher(
        KVEventsSettings(True, "zmq", endpoint, replay_endpoint if replay else None)
    )
    publisher.start()
    context = zmq.asyncio.Context()
    registry = CollectorRegistry()
    subscriber = EventSubscriber(
        "p0",
        endpoint,
        replay_endpoint if replay else None,
        InstanceBlocks(),
        KvMetrics(registry),
        context=context,
        warm=warm,
    )
    subscriber.registry = registry  # type: ignore[attr-defined]
    task = asyncio.create_task(subscriber.run())
    try:
        yield publisher, subscriber
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        context.destroy(linger=0)
        await publisher.stop()


async def in_step(publisher: KvEventPublisher, subscriber: EventSubscriber) -> list[list[int]]:
    """Publish until the subscriber has applied the newest batch live (a PUB socket drops
    what it sends before the subscription is up); returns every sequence published."""
    published: list[list[int]] = []

    async def publish_and_look() -> bool:
        ids, event = new_block()
        published.append(ids)
        await publisher.publish([event])
        try:
            await eventually(
                lambda: _ready(
                    subscriber.last == publisher.last_seq and holds(subscriber.blocks, ids)
                ),
                what="the batch arrives",
                timeout=0.5,
            )
        except AssertionError:
            return False
        return True

    await eventually(publish_and_look, what="the subscriber is in step", timeout=30)
    return published


async def _ready(value: bool) -> bool:
    return value


def sample(subscriber: EventSubscriber, name: str, **labels: str) -> float:
    registry: CollectorRegistry = subscriber.registry  # type: ignore[attr-defined]
    return registry.get_sample_value(name, {"server": "p0", **labels}) or 0.0


async def test_what_was_published_before_the_subscription_comes_back_by_replay() -> None:
    async with pair() as (publisher, subscriber):
        early = [new_block() for _ in range(3)]
        for _, event in early:
            await publisher.publish([event])
        published = await in_step(publisher, subscriber)
        assert all(holds(subscriber.blocks, ids) for ids, _ in early)
        assert all(holds(subscriber.blocks, ids) for ids in published)


async def test_a_gap_is_filled_from_the_replay_socket() -> None:
    async with pair() as (publisher, subscriber):
        await in_step(publisher, subscriber)
        publisher.drop_next = 2  # two batches never reach the PUB socket
        sent = [new_block() for _ in range(3)]
        for _, event in sent:
            await publisher.publish([event])
        await eventually(
            lambda: _ready(subscriber.last == publisher.last_seq), what="the third batch"
        )
        assert all(holds(subscriber.blocks, ids) for ids, _ in sent)
        assert sample(subscriber, "carryover_kv_event_replays_total", outcome="recovered") >= 2
        assert sample(subscriber, "carryover_kv_index_resets_total", cause="lost_events") == 0


async def test_a_gap_without_replay_drops_what_is_known() -> None:
    async with pair(replay=False) as (publisher, subscriber):
        before = await in_step(publisher, subscriber)
        publisher.drop_next = 1
        lost, _ = new_block()
        after, _ = new_block()
        await publisher.publish([Stored([lost[0]], None, lost, SIZE, None, "GPU", None)])
        await publisher.publish([Stored([after[0]], None, after, SIZE, None, "GPU", None)])
        await eventually(
            lambda: _ready(subscriber.last == publisher.last_seq), what="the batch after the gap"
        )
        # A lost removal would stay forever: everything from before the gap is dropped.
        assert not holds(subscriber.blocks, before[-1]) and not holds(subscriber.blocks, lost)
        assert holds(subscriber.blocks, after)
        assert sample(subscriber, "carryover_kv_index_resets_total", cause="lost_events") == 1


async def test_a_restarted_engine_starts_the_index_again() -> None:
    async with pair() as (publisher, subscriber):
        before = await in_step(publisher, subscriber)
        publisher.restart()  # sequence back to 0, nothing buffered
        published = await in_step(publisher, subscriber)
        assert not any(holds(subscriber.blocks, ids) for ids in before)
        assert holds(subscriber.blocks, published[-1])
        assert sample(subscriber, "carryover_kv_index_resets_total", cause="restart") == 1


async def test_the_warm_tiers_chunks_are_the_tiers_and_outlive_an_engine_restart() -> None:
    # LMCache's MP connector reports the shared server's chunks (medium CPU, its own chunk
    # size) in the engine's stream; a restart of the engine does not empty the server.
    tier = WarmTier(WarmTierConfig(name="lmcache", medium="CPU", chunk_tokens=2 * SIZE))
    async with pair(warm=tier) as (publisher, subscriber):
        await in_step(publisher, subscriber)
        chunk = [next(_tokens) for _ in range(2 * SIZE)]
        await publisher.publish([Stored([chunk[0]], None, chunk, 2 * SIZE, None, "CPU", None)])
        await eventually(
            lambda: _ready(subscriber.last == publisher.last_seq), what="the chunk's batch"
        )
        assert tier.held(Prompt(chunk + [1, 2])) == 2 * SIZE
        assert subscriber.blocks.cached(Prompt(chunk).keys(SIZE)).tokens == 0
        assert subscriber.blocks.skipped == {}
        publisher.restart()
        published = await in_step(publisher, subscriber)
        assert holds(subscriber.blocks, published[-1])
        assert tier.held(Prompt(chunk)) == 2 * SIZE
        registry: CollectorRegistry = subscriber.registry  # type: ignore[attr-defined]
        assert registry.get_sample_value("carryover_kv_index_blocks", {"server": "lmcache"}) == 1
