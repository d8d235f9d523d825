"""Simulated engines for tests, in-process on free loopback ports."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import cache
from typing import Any

from carryover.bench.sim.chat import SimTemplate
from carryover.bench.sim.config import KVConnectorExtra, KVTransferConfig, SimConfig
from carryover.bench.sim.kv_events import KVEventsSettings
from carryover.bench.sim.server import SimServer
from carryover.bench.sim.timing import Timing
from tests.support.ports import free_port

MODEL = "sim-qwen3"


@cache
def qwen3() -> SimTemplate:
    """The simulated engines' own chat rendering (``bench/sim/chat.py``): it shares no code
    with the router's, so a turn's checked ids are compared with an independent render."""
    return SimTemplate.qwen3()


def sim_config(
    role: str | None,
    *,
    bidirectional: bool = True,
    policy: str = "fail",
    ttl: float = 480.0,
    lease: float = 30.0,
    threshold: int = 64,
    speed: float = 0.0,
    kv_events: bool = False,
    **overrides: Any,
) -> SimConfig:
    kv = None
    if role is not None:
        kv = KVTransferConfig(
            kv_connector="NixlConnector",
            kv_role=role,
            kv_load_failure_policy=policy,
            kv_connector_extra_config=KVConnectorExtra(
                bidirectional_kv_xfer=bidirectional,
                kv_recompute_threshold=threshold,
                decoder_kv_blocks_ttl=ttl,
                kv_lease_duration=lease,
            ),
        )
    fields: dict[str, Any] = {
        "model": MODEL,
        "served_model_name": MODEL,
        "port": free_port(),
        "side_channel_host": "127.0.0.1",
        "side_channel_port": free_port(),
        "kv_transfer": kv,
        "timing": Timing(speed=speed),
        "num_blocks": 4096,
        "kv_events": (
            KVEventsSettings(
                enable_kv_cache_events=True,
                publisher="zmq",
                endpoint=f"tcp://127.0.0.1:{free_port()}",
                replay_endpoint=f"tcp://127.0.0.1:{free_port()}",
            )
            if kv_events
            else None
        ),
    }
    fields.update(overrides)
    return SimConfig(**fields)


@asynccontextmanager
async def running(config: SimConfig) -> AsyncIterator[SimServer]:
    server = SimServer(config, qwen3())
    await server.start()
    try:
        yield server
    finally:
        await server.stop()


@asynccontextmanager
async def pd_pair(**kwargs: Any) -> AsyncIterator[tuple[SimServer, SimServer]]:
    """A prefill and a decode instance with bidirectional transfer (options apply to both)."""
    p_extra = {k[2:]: v for k, v in kwargs.items() if k.startswith("p_")}
    d_extra = {k[2:]: v for k, v in kwargs.items() if k.startswith("d_")}
    common = {k: v for k, v in kwargs.items() if not k.startswith(("p_", "d_"))}
    async with (
        running(sim_config("kv_producer", **{**common, **p_extra})) as p,
        running(sim_config("kv_consumer", **{**common, **d_extra})) as d,
    ):
        yield p, d
