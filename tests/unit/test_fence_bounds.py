"""DELETE fences a conversation so that a turn still running cannot store it again. Fences of
ids that were never stored cost the same: a flood of them is bounded, and sweeping them costs
the ones that ended, not the ones held."""

from __future__ import annotations

import time

from prometheus_client import generate_latest

from carryover.router.fleet.held import report_held
from carryover.router.metrics import RouterMetrics
from carryover.state import ConversationKey, Kept, MemoryStore
from tests.support.records import make_record


def _key(n: int) -> ConversationKey:
    return ConversationKey("acme", "m", f"never-stored-{n}")


async def test_a_flood_of_deletes_for_unknown_ids_keeps_at_most_the_fence_limit() -> None:
    now = [1000.0]
    store = MemoryStore(clock=lambda: now[0], fence_limit=1000)
    for n in range(5000):
        assert await store.delete(_key(n), fence=900) is None
    assert store.kept()[Kept.FENCES] == 1000 and store.fences_evicted == 4000
    # The newest fences still hold: a turn that ran across its DELETE stores nothing...
    late = await store.commit(_key(4999), make_record(2), now=now[0], running_for=5.0)
    assert late.ended and not late.written
    # ...the oldest went first, at the limit.
    early = await store.commit(_key(0), make_record(2), now=now[0], running_for=5.0)
    assert early.written


async def test_fences_that_ended_are_swept_and_the_rest_kept() -> None:
    now = [1000.0]
    store = MemoryStore(clock=lambda: now[0])
    for n in range(300):
        await store.delete(_key(n), fence=900)
        now[0] += 1.0
    now[0] = 1000.0 + 900 + 100.5  # the first 101 have ended
    await store.held([], now=now[0])
    assert store.kept()[Kept.FENCES] == 199
    # A DELETE again moves an id's fence to its new place in the order of ending.
    await store.delete(_key(150), fence=900)
    now[0] += 899
    await store.held([], now=now[0])
    assert store.kept()[Kept.FENCES] == 1


async def test_what_the_store_keeps_is_on_metrics() -> None:
    """Operators see each bounded structure's size: ``carryover_store_kept{kind}``."""
    store = MemoryStore(fence_limit=10)
    for n in range(25):
        await store.delete(_key(n), fence=900)
    await store.commit(_key(99), make_record(1, decode="d0"), now=time.time())
    metrics = RouterMetrics()
    await report_held(store, ["d0"], metrics)
    text = generate_latest(metrics.registry).decode()
    assert 'carryover_store_kept{kind="fences"} 10.0' in text
    assert 'carryover_store_kept{kind="records"} 1.0' in text
