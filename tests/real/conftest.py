"""The real-engine tier: vLLM's CPU build with NIXL, a seeded random tiny Qwen3, real Redis.

One P/D pair runs at a time (a start takes a minute or two on 2 cores, and two pairs would
share the cores four ways); tests that need other router settings start their own router in
front of it. Three configurations exist, each started once per run, in this order:

- ``pd``: P keeps a prefix cache and runs in dev mode (``/reset_prefix_cache``) with the
  render server's parsers, so it also answers as ``vllm serve`` does; D keeps its cache. A
  test that counts what P pulled empties P's cache before each routed turn
  (``helpers.forget_prefill_cache``), so P finds nothing of its own and pulls exactly what the
  handle covers; references carry a fresh ``cache_salt`` (``helpers.salted``).
- ``warm``: both engines also reach an LMCache server; P has no prefix cache, so all it did
  not compute came from LMCache. The restart test brings the pair back in this
  configuration, on the same ports: a restart of both engines, and the start of the next
  configuration, at once.
- ``tokens``: ``--tokens-only`` engines behind a render server.
- ``llama2`` and ``mistral``: a pair of each of the other model families the tier builds
  (``bench/real/make_model.py``), as ``pd`` (dev mode too) but without parsers, for the render check and
  reuse on their tokenizers and templates.

Each test module says which configuration it needs with ``@pytest.mark.engines(kind)``; the
collection hook below runs the tier in that order whatever ``-k``, ``--lf`` or file names
select, and ``Engines`` starts a configuration when the first test that needs it runs.

No test here races a clock: D pins a turn's blocks for an hour and the routers are told so, far
beyond any turn of a slow or loaded machine (a first forward pass took 41 s on two busy cores).
What expiry does is tested by moving time explicitly (``test_expired_handles_are_served_cold``)
and, in full, against the simulator, whose clock tests drive.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from carryover.bench.real.launch import FAMILIES, EngineDied, VllmPair
from carryover.bench.real.lmcache import LmcacheServer
from carryover.bench.redis_server import RedisServer
from tests.real.served import SERVER_PARSERS, ServedAnswers, record_served_answers
from tests.support.http import ResendStaleGets
from tests.support.metrics import OPERATOR_KEY
from tests.support.router_proc import RouterProcess

pytestmark = pytest.mark.real

#: D's pins live this long (an hour: no test outlives one by accident); the router is told the
#: same. D has 8192 blocks of 128 tokens, so a session's pins take a few percent of it.
D_TTL = 3600.0

#: The configurations, in the order the tier runs them.
PHASES = ("pd", "restart", "warm", "tokens", "llama2", "mistral")


def _phase(item: pytest.Item) -> int | None:
    marker = item.get_closest_marker("engines")
    return None if marker is None else PHASES.index(marker.args[0])


#: Tests of this tier that start no engine: they run before the first engine starts, so that
#: no engine shares the CPU with them.
_BEFORE_ENGINES = ("test_render_vllm.py", "test_engine_site.py", "test_kv_wire_vllm.py")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The tier's tests in the order of ``PHASES`` (stable within a phase), in the places the
    tier's tests already hold in the run: each configuration then starts once. Those of
    ``_BEFORE_ENGINES`` go before all of them."""
    places = [i for i, item in enumerate(items) if _phase(item) is not None]
    ordered = sorted((items[i] for i in places), key=lambda item: _phase(item) or 0)
    for place, item in zip(places, ordered, strict=True):
        items[place] = item
    early = [item for item in items if item.path.name in _BEFORE_ENGINES]
    if early and places:
        rest = [item for item in items if item.path.name not in _BEFORE_ENGINES]
        first = rest.index(items[places[0]])  # the first test to start engines
        items[:] = rest[:first] + early + rest[first:]


class Engines:
    """At most one running pair, of the configuration the current test asks for."""

    def __init__(self, log_dir: Path, *, record_served: bool = False) -> None:
        self.log_dir = log_dir
        self.running: VllmPair | None = None
        self.kind: str | None = None
        #: Record ``vllm serve``'s answers (tests/real/served.py) when ``pd`` starts.
        self.record_served = record_served
        self.served: ServedAnswers | None = None

    def _configured(self, kind: str, like: VllmPair | None = None) -> VllmPair:
        family = kind if kind in FAMILIES else "qwen3"
        # P keeps its prefix cache in ``pd`` and the other families' pairs (their tests salt
        # each turn); in ``warm`` what P did not compute came from LMCache, by its counters.
        p_args = ["--no-enable-prefix-caching"]
        if kind == "pd":
            p_args = [*SERVER_PARSERS]
        elif family != "qwen3":
            p_args = []
        return VllmPair(
            log_dir=self.log_dir / kind,
            d_extra={"decoder_kv_blocks_ttl": D_TTL},
            p_args=p_args,
            tokens_only=kind == "tokens",
            # Both publish KV events: every router of this tier keeps an index of them, so
            # the subscriber meets vLLM's own wire format in every test.
            kv_events=True,
            dev_mode=kind in ("pd", *FAMILIES),  # POST /reset_prefix_cache
            lmcache=LmcacheServer(self.log_dir / kind / "lmcache.log") if kind == "warm" else None,
            # A restart keeps the ports: to a router it is the same instance, come back.
            prefill=None if like is None else like.prefill,
            decode=None if like is None else like.decode,
            family=family,
        )

    def pair(self, kind: str) -> VllmPair:
        if self.kind == kind and self.running is not None:
            return self.running
        self.stop()
        if self.record_served and self.served is None and kind != "pd":
            # A run that selected no test of ``pd`` still records on it, before the rest.
            self._start("pd", self._configured("pd"))
            self.stop()
        return self._start(kind, self._configured(kind))

    def restart_as(self, kind: str) -> VllmPair:
        """Stop the running pair and start ``kind`` on its ports: both engines come back with
        new engine ids where a router knew them."""
        assert self.running is not None
        like = self.running
        self.stop()
        return self._start(kind, self._configured(kind, like))

    def _start(self, kind: str, pair: VllmPair) -> VllmPair:
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
        if kind == "pd" and self.record_served and self.served is None:
            assert pair.prefill is not None
            self.served = record_served_answers(pair.prefill.url)
        return pair

    def stop(self) -> None:
        if self.running is not None:
            self.running.stop()
        self.running = self.kind = None


# Package scope: the engines stop when this tier ends, so the tests after it do not share the
# two cores with a pair of spinning engines.
@pytest.fixture(scope="package")
def engines(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Engines]:
    # ``vllm serve``'s answers are recorded on ``pd``'s P, when a test of the run needs them.
    served = any("served_answers" in getattr(i, "fixturenames", ()) for i in request.session.items)
    manager = Engines(tmp_path_factory.mktemp("vllm-logs"), record_served=served)
    try:
        yield manager
    finally:
        manager.stop()


@pytest.fixture
def vllm_pair(engines: Engines) -> VllmPair:
    return engines.pair("pd")


@pytest.fixture
def served_answers(engines: Engines) -> ServedAnswers:
    """``vllm serve``'s answers to ``served.CASES``, recorded when ``pd`` started (first in
    every run that selects a test needing them)."""
    assert engines.served is not None
    return engines.served


@pytest.fixture
async def client() -> AsyncIterator[httpx.AsyncClient]:
    # vLLM closes idle connections after 5 s; a request sent on one at that moment is reset.
    transport = ResendStaleGets(limits=httpx.Limits(keepalive_expiry=2))
    async with httpx.AsyncClient(timeout=600, transport=transport) as c:
        yield c


#: The admin key the tier's routers get (by the environment: no flag carries a secret).
ADMIN_ENV = {"CARRYOVER_ADMIN_KEY": OPERATOR_KEY}


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
        # event loop can be starved past the 0.25 s default store deadline. A CI run saw a
        # claim time out at 5 s (the turn went cold-error) while D's API server logged nothing
        # for 40 s: these are failure bounds here, what a store or probe timeout does is tested
        # against the simulator.
        "--health-timeout",
        "60",
        "--store-timeout",
        "60",
        # A router starved for tens of seconds by the engines beside it was seen to miss a
        # 10 s connect deadline to D (its own loop ran late, not D).
        "--connect-timeout",
        "60",
        "--prefill-timeout",
        "120",
        "--first-byte-timeout",
        "300",
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


@contextlib.contextmanager
def module_router(
    pair: VllmPair, redis: RedisServer, log_dir: Path, *extra: str
) -> Iterator[RouterProcess]:
    """``routed`` for a module's fixture, set up where no event loop runs: the router's start
    is awaited on a loop of its own in a worker thread (the engines are processes of their
    own, so nothing in this thread needs to answer meanwhile)."""
    router = RouterProcess(router_flags(pair, redis, *extra), log_dir, env=ADMIN_ENV)
    try:
        with ThreadPoolExecutor(1) as starter:
            starter.submit(asyncio.run, router.start(timeout=180)).result()
        yield router
    finally:
        router.stop()


@contextlib.asynccontextmanager
async def routed(
    pair: VllmPair,
    redis: RedisServer,
    log_dir: Path,
    *extra: str,
    env: dict[str, str] | None = None,
) -> AsyncIterator[RouterProcess]:
    """A router in front of ``pair`` (``env`` added to its environment), stopped at the end
    (also when the test fails)."""
    router = RouterProcess(
        router_flags(pair, redis, *extra), log_dir, env={**ADMIN_ENV, **(env or {})}
    )
    try:
        await router.start(timeout=180)
        yield router
    finally:
        router.stop()


# One router per module: its tests use their own conversations and read its counters as
# differences, so it need not start and stop for each of them.
@pytest.fixture(scope="module")
def real_router(
    engines: Engines, redis_server: RedisServer, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RouterProcess]:
    with module_router(engines.pair("pd"), redis_server, tmp_path_factory.mktemp("router")) as r:
        yield r
