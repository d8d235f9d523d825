"""A decode restart's epoch bump, as routers make it in the store (router/fleet/pool.py)."""

from __future__ import annotations

from typing import cast

from carryover.router.config.load import load_config
from carryover.router.engines.upstream import Upstream
from carryover.router.fleet.pool import InstancePool
from carryover.router.metrics import RouterMetrics
from carryover.state import MemoryStore


async def test_a_bump_the_store_lost_is_made_again_at_the_next_probe() -> None:
    config = load_config(["--prefill", "http://p:1", "--decode", "http://d:1"], environ={})
    store = MemoryStore()
    pool = InstancePool(config, cast(Upstream, None), store, RouterMetrics())
    decode = next(i for i in pool.instances if i.role == "decode")
    await pool._observe_identity(decode, 100.0, restarted=False)
    await pool._observe_identity(decode, 200.0, restarted=False)  # D restarted
    assert (await store.epochs([decode.name]))[decode.name] == decode.epoch == 1
    # A failover brings back a store from before the bump: the old identity, epoch 0.
    store._identities[decode.name] = repr(100.0)
    store._epochs[decode.name] = 0
    await pool._observe_identity(decode, 200.0, restarted=False)  # the next probe, same D
    assert (await store.epochs([decode.name]))[decode.name] == decode.epoch == 1
