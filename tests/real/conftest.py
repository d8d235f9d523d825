"""The real-engine tier: vLLM's CPU build with NIXL, a seeded random tiny Qwen3, real Redis.

One P/D pair serves the whole tier (a start takes a minute or two on 2 cores); tests that
need other router settings start their own router in front of it.

No test here races a clock: D pins a turn's blocks for an hour and the routers are told so, far
beyond any turn of a slow or loaded machine (a first forward pass took 41 s on two busy cores).
What expiry does is tested by moving time explicitly (``test_expired_handles_are_served_cold``)
and, in full, against the simulator, whose clock tests drive.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from bench.real.launch import VllmPair
from tests.support.redis_server import RedisServer
from tests.support.router_proc import RouterProcess

pytestmark = pytest.mark.real

#: D's pins live this long (an hour: no test outlives one by accident); the router is told the
#: same. D has 8192 blocks of 128 tokens, so a session's pins take a few percent of it.
D_TTL = 3600.0


# Package scope: the engines stop when this tier ends, so the tests after it do not share the
# two cores with a pair of spinning engines.
@pytest.fixture(scope="package")
def vllm_pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmPair]:
    pair = VllmPair(
        log_dir=tmp_path_factory.mktemp("vllm-logs"),
        d_extra={"decoder_kv_blocks_ttl": D_TTL},
        # Without a prefix cache on P every pull is whole, so P's counters say exactly what
        # the router attached; D keeps its cache (the realistic side).
        p_args=["--no-enable-prefix-caching"],
        # Both publish KV events: every router of this tier keeps an index of them, so the
        # subscriber meets vLLM's own wire format in every test.
        kv_events=True,
    )
    try:  # a failed start or warm-up stops both engines too
        pair.start()
        pair.warm_up()
        yield pair
    finally:
        pair.stop()


def router_flags(pair: VllmPair, redis: RedisServer, *extra: str) -> list[str]:
    assert pair.prefill is not None and pair.decode is not None
    return [
        "--prefill",
        pair.prefill.url,
        "--decode",
        pair.decode.url,
        "--redis",
        redis.url,
        "--block-size",
        "128",
        "--decoder-kv-blocks-ttl",
        str(D_TTL),
        "--queue-margin",
        "1",
        "--health-interval",
        "0.5",
        # Two CPU engines keep both cores busy: /health can take seconds, and the router's own
        # event loop can be starved past the 0.25 s default store deadline.
        "--health-timeout",
        "10",
        "--store-timeout",
        "5",
        # A router starved for tens of seconds by the engines beside it was seen to miss a
        # 10 s connect deadline to D (its own loop ran late, not D).
        "--connect-timeout",
        "60",
        "--prefill-timeout",
        "120",
        "--first-byte-timeout",
        "300",
        "--admin-key",
        "admin-secret",
        *(
            flag
            for instance in (pair.prefill, pair.decode)
            for flag in (
                "--kv-events",
                f"{instance.url}={instance.kv_events}",
                "--kv-events-replay",
                f"{instance.url}={instance.kv_events_replay}",
            )
        ),
        *extra,
    ]


@pytest.fixture
async def real_router(
    vllm_pair: VllmPair, redis_server: RedisServer, tmp_path: Path
) -> AsyncIterator[RouterProcess]:
    router = RouterProcess(router_flags(vllm_pair, redis_server), tmp_path)
    await router.start(timeout=180)
    yield router
    router.stop()
