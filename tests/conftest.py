from __future__ import annotations

import os
import random
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

from carryover.bench.redis_server import RedisServer
from carryover.bench.redis_topologies import RedisCluster, RedisSentinels
from tests.explore.budget import EXPLORE_SEED, EXPLORED_SCHEDULES, EXPLORED_SWEEPS
from tests.support.reaper import start_watchdog
from tests.support.secrets import REDIS_PASSWORD

# Property tests judge answers, not speed: no per-example deadline and no "too slow" health
# check, which a loaded 2-core machine would trip.
settings.register_profile("carryover", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("carryover")


def pytest_configure(config: pytest.Config) -> None:
    # Whatever the run starts dies with it, also when it is killed (tests/support/reaper.py).
    start_watchdog(config)
    # The fault-schedule exploration's seed: drawn once by the process that starts the run,
    # so its workers share it and the header prints it (tests/explore/).
    os.environ.setdefault(EXPLORE_SEED, str(random.SystemRandom().randrange(2**32)))
    # A worker of a parallel run (pytest-xdist) draws free ports from a share of its own.
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if worker is not None:
        count = os.environ["PYTEST_XDIST_WORKER_COUNT"]
        os.environ["CARRYOVER_PORT_SHARE"] = f"{worker.removeprefix('gw')}/{count}"


def pytest_report_header(config: pytest.Config) -> str:
    return (
        f"fault-schedule exploration: seed {os.environ[EXPLORE_SEED]}, {EXPLORED_SCHEDULES} "
        f"random schedules and {EXPLORED_SWEEPS} sweeps (replay: {EXPLORE_SEED}=SEED)"
    )


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """One redis-server for the session (tests use their own key namespaces)."""
    server = RedisServer(tmp_path_factory.mktemp("redis"))
    server.start()
    yield server
    server.kill()


@pytest.fixture
def own_redis(tmp_path: Path) -> Iterator[RedisServer]:
    """A redis-server of this test's own, free to be killed and restarted."""
    server = RedisServer(tmp_path / "redis")
    server.start()
    yield server
    server.kill()


@pytest.fixture
def protected_redis(tmp_path: Path) -> Iterator[RedisServer]:
    """A redis-server of this test's own that wants ``REDIS_PASSWORD``."""
    server = RedisServer(
        tmp_path / "protected-redis",
        extra=["--requirepass", REDIS_PASSWORD],
        auth=("default", REDIS_PASSWORD),
    )
    server.start()
    yield server
    server.kill()


# Per module, not per session: the nodes' background work (gossip, Sentinel pings) would
# otherwise go on through the real-vLLM tier, which needs every cycle of the two cores.
@pytest.fixture(scope="module")
def redis_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisCluster]:
    """A 3-primary/3-replica Redis Cluster for a module (tests use their own namespaces)."""
    cluster = RedisCluster(tmp_path_factory.mktemp("redis-cluster"))
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture(scope="module")
def redis_sentinels(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisSentinels]:
    """A primary and a replica watched by three Sentinels, for a module."""
    sentinels = RedisSentinels(tmp_path_factory.mktemp("redis-sentinel"))
    try:
        sentinels.start()
        yield sentinels
    finally:
        sentinels.stop()
