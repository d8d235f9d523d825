"""The simulator's KV-event encoder (bench/sim/kv_wire.py) and the router's mirror of vLLM's
classes (router/kv/events.py) write the same bytes for every shape of batch; the real tier
checks the simulator's against vLLM's own classes (tests/real/test_kv_wire_vllm.py)."""

from __future__ import annotations

from typing import Any

import pytest

from carryover.bench.sim.kv_wire import encode_batch
from carryover.router.kv import events as router_events
from tests.unit.sim.cases import CASES, sim_events


def _router_bytes(ts: float, events: list[tuple[str, dict[str, Any]]], rank: int | None) -> bytes:
    made = [getattr(router_events, name)(**fields) for name, fields in events]
    return router_events.encode_batch(router_events.KVEventBatch(ts, made, rank))


@pytest.mark.parametrize("case", CASES, ids=lambda case: str(case[0]))
def test_the_simulator_and_the_router_encode_a_batch_byte_for_byte_alike(case: Any) -> None:
    ts, events, rank = case
    assert encode_batch(ts, sim_events(events), rank) == _router_bytes(ts, events, rank)


@pytest.mark.parametrize("case", CASES, ids=lambda case: str(case[0]))
def test_the_router_decodes_what_the_simulator_sends(case: Any) -> None:
    ts, events, rank = case
    batch, skipped = router_events.decode_batch(encode_batch(ts, sim_events(events), rank))
    assert skipped == 0 and batch.ts == ts and batch.data_parallel_rank == rank
    assert [type(event).__name__ for event in batch.events] == [name for name, _ in events]
