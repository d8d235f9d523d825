"""Pressure relief across processes: every worker of every replica probes the same usage of a
full decode instance, and together they give back what one process would (router/fleet/pressure.py)."""

from __future__ import annotations

import asyncio
import time
import uuid

import msgspec

from carryover.bench.redis_server import RedisServer
from carryover.router.config import InstanceConfig, ModelConfig
from carryover.router.fleet.instance import Breaker, Instance
from carryover.router.fleet.pressure import Release, relieve, share_to_release
from carryover.router.handles.ledger import HandleLedger
from carryover.router.metrics import RouterMetrics
from carryover.state import ConversationKey, MemoryStore, Record, RedisStore
from tests.support.records import make_record

HIGH, LOW = 0.9, 0.75


def _recorder() -> tuple[list[Record], Release]:
    """A release that only notes what it was given."""
    released: list[Record] = []

    async def release(_: Instance, record: Record) -> bool:
        released.append(record)
        return True

    return released, release


async def test_four_processes_relieving_at_once_give_back_what_one_would(
    redis_server: RedisServer,
) -> None:
    namespace = f"t{uuid.uuid4().hex}"
    stores = [
        RedisStore.from_url(redis_server.url, namespace=namespace, timeout=2.0) for _ in range(4)
    ]
    try:
        for i in range(100):
            record = make_record(1, decode="d0")
            await stores[0].commit(ConversationKey("acme", "m", f"c{i}"), record, now=time.time())
        model = ModelConfig(prefill=[], decode=[InstanceConfig(url="http://d0", name="d0")])
        released, release = _recorder()

        async def one_process(store: RedisStore) -> int:
            decode = Instance(model.decode[0], "decode", model, Breaker(3, 5.0))
            decode.kv_usage = 0.95  # as every process's probe reads it
            metrics = RouterMetrics()
            return await relieve(
                store,
                [decode],
                release,
                HandleLedger(metrics),
                metrics,
                high_water=HIGH,
                low_water=LOW,
                now=time.time(),
                period=5.0,
            )

        given_back = await asyncio.gather(*(one_process(s) for s in stores))
        one_would = share_to_release(0.95, 100, high_water=HIGH, low_water=LOW)
        assert sum(given_back) == len(released) == one_would
        assert sorted(given_back) == [0, 0, 0, one_would]  # one process had the turn
        held = await stores[1].held(["d0"], now=time.time())
        assert held["d0"].count == 100 - one_would
    finally:
        for store in stores:
            await store.close()


async def test_relief_passes_by_shadowed_records_and_sizes_its_share_by_the_others() -> None:
    # A D filled mostly by pins of tokens-only streams: their captured handles are shadowed
    # (releasing them frees next to nothing), two other conversations' are not.
    store = MemoryStore()
    now = time.time()
    for i in range(12):
        record = msgspec.structs.replace(make_record(1, decode="d0"), shadowed=i >= 2)
        await store.commit(ConversationKey("acme", "m", f"c{i}"), record, now=now)
    model = ModelConfig(prefill=[], decode=[InstanceConfig(url="http://d0", name="d0")])
    decode = Instance(model.decode[0], "decode", model, Breaker(3, 5.0))
    decode.kv_usage = 0.95
    released, release = _recorder()

    metrics = RouterMetrics()
    for second in range(3):  # three passes, usage as high as ever: never a shadowed one
        await relieve(
            store,
            [decode],
            release,
            HandleLedger(metrics),
            metrics,
            high_water=HIGH,
            low_water=LOW,
            now=now + second * 5.0,
            period=5.0,
        )
    assert released and not any(r.shadowed for r in released)
    assert len(released) == 2  # 1 (the share of 2), then the last one; the 10 stay stored
    assert (await store.held(["d0"], now=now))["d0"].count == 10
