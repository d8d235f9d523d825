"""The real-engine tier: vLLM's CPU build with NIXL, a seeded random tiny Qwen3, real Redis.

One P/D pair runs at a time (a start takes a minute or two on 2 cores, and two pairs would
share the cores four ways); tests that need other router settings start their own router in
front of it. Two configurations exist: ``vllm_pair``, whose P has no prefix cache (so P's
counters say exactly what the router attached), and ``cached_pair``, whose P keeps one (what a
turn without a handle finds there). ``Engines`` swaps them when a test asks for the other;
the modules are named so that each configuration is started once (``test_caches.py`` first,
``test_zzw_warm.py``, whose pair reaches an LMCache server, next to last, and
``test_zzz_tokens.py``, whose pair runs ``--tokens-only``, last).

No test here races a clock: D pins a turn's blocks for an hour and the routers are told so, far
beyond any turn of a slow or loaded machine (a first forward pass took 41 s on two busy cores).
What expiry does is tested by moving time explicitly (``test_expired_handles_are_served_cold``)
and, in full, against the simulator, whose clock tests drive.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import pytest

from bench.real.launch import EngineDied, VllmPair
from bench.real.lmcache import LmcacheServer
from bench.redis_server import RedisServer
from tests.support.http import ResendStaleGets
from tests.support.router_proc import RouterProcess

pytestmark = pytest.mark.real

#: D's pins live this long (an hour: no test outlives one by accident); the router is told the
#: same. D has 8192 blocks of 128 tokens, so a session's pins take a few percent of it.
D_TTL = 3600.0


class Engines:
    """At most one running pair, of the configuration the current test asks for."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.running: VllmPair | None = None
        self.kind: str | None = None

    def pair(self, kind: str) -> VllmPair:
        if self.kind == kind and self.running is not None:
            return self.running
        self.stop()
        pair = VllmPair(
            log_dir=self.log_dir / kind,
            d_extra={"decoder_kv_blocks_ttl": D_TTL},
            # Without a prefix cache on P every pull is whole, so P's counters say exactly
            # what the router attached; D keeps its cache (the realistic side).
            p_args=[] if kind == "cached" else ["--no-enable-prefix-caching"],
            tokens_only=kind == "tokens",  # test_zzz_tokens.py, the last module
            # Both publish KV events: every router of this tier keeps an index of them, so
            # the subscriber meets vLLM's own wire format in every test.
            kv_events=True,
            dev_mode=kind == "cached",  # POST /reset_prefix_cache
            # test_zzw_warm.py: both engines also reach an LMCache server (the warm tier).
            lmcache=LmcacheServer(self.log_dir / kind / "lmcache.log") if kind == "warm" else None,
        )
        for attempt in (1, 2):
            try:  # a failed start or warm-up stops both engines too
                pair.start()
                pair.warm_up()
                break
            except EngineDied:
                pair.stop()
                if attempt == 2:
                    raise
            except BaseException:
                pair.stop()
                raise
        self.running, self.kind = pair, kind
        return pair

    def stop(self) -> None:
        if self.running is not None:
            self.running.stop()
        self.running = self.kind = None


# Package scope: the engines stop when this tier ends, so the tests after it do not share the
# two cores with a pair of spinning engines.
@pytest.fixture(scope="package")
def engines(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engines]:
    manager = Engines(tmp_path_factory.mktemp("vllm-logs"))
    try:
        yield manager
    finally:
        manager.stop()


@pytest.fixture
def vllm_pair(engines: Engines) -> VllmPair:
    return engines.pair("plain")


@pytest.fixture
def cached_pair(engines: Engines) -> VllmPair:
    return engines.pair("cached")


@pytest.fixture
async def client() -> AsyncIterator[httpx.AsyncClient]:
    # vLLM closes idle connections after 5 s; a request sent on one at that moment is reset.
    transport = ResendStaleGets(limits=httpx.Limits(keepalive_expiry=2))
    async with httpx.AsyncClient(timeout=600, transport=transport) as c:
        yield c


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


@contextlib.asynccontextmanager
async def routed(
    pair: VllmPair, redis: RedisServer, log_dir: Path, *extra: str
) -> AsyncIterator[RouterProcess]:
    """A router in front of ``pair``, stopped at the end (also when the test fails)."""
    router = RouterProcess(router_flags(pair, redis, *extra), log_dir)
    try:
        await router.start(timeout=180)
        yield router
    finally:
        router.stop()


@pytest.fixture
async def real_router(
    vllm_pair: VllmPair, redis_server: RedisServer, tmp_path: Path
) -> AsyncIterator[RouterProcess]:
    async with routed(vllm_pair, redis_server, tmp_path) as router:
        yield router


@pytest.fixture
async def cached_router(
    cached_pair: VllmPair, redis_server: RedisServer, tmp_path: Path
) -> AsyncIterator[RouterProcess]:
    async with routed(cached_pair, redis_server, tmp_path) as router:
        yield router
