from __future__ import annotations

import asyncio
import contextlib
import time
from pathlib import Path
from typing import cast

import pytest

from carryover.router.config.load import load_config
from carryover.router.engines.upstream import Upstream
from carryover.router.errors import EngineFailed, EngineTimeout
from carryover.router.fleet.instance import Breaker, Instance
from carryover.router.fleet.pool import InstancePool
from carryover.router.metrics import RouterMetrics
from carryover.state import MemoryStore
from tests.support.metrics import parse


def test_breaker_opens_half_opens_for_one_trial_and_closes() -> None:
    breaker = Breaker(threshold=3, reset=5.0)
    for _ in range(2):
        breaker.failure(now=0.0)
    assert breaker.allows(1.0) and breaker.state == "closed"
    breaker.failure(now=1.0)
    assert breaker.state == "open" and not breaker.allows(5.9)
    assert breaker.allows(6.0)  # reset elapsed: one trial may go
    breaker.begin()
    assert breaker.state == "half_open" and not breaker.allows(6.1)
    breaker.failure(now=6.2)  # the trial failed: open for another period
    assert not breaker.allows(11.0) and breaker.allows(11.3)
    breaker.begin()
    breaker.success()
    assert breaker.state == "closed" and breaker.allows(11.4) and breaker.failures == 0


def test_error_answers_of_one_tenant_never_open_the_circuit_for_the_others() -> None:
    """With two tenants, answers only one tenant's requests get (what it sends may cause
    them) fail those requests alone; a second tenant's, or any engine-wide failure, is the
    engine's."""
    breaker = Breaker(threshold=3, reset=5.0, tenants_to_blame=2)
    for _ in range(10):
        breaker.failure(now=0.0, tenant="alpha")
    assert breaker.state == "closed" and breaker.allows(0.0)
    breaker.failure(now=0.0, tenant="beta")
    assert breaker.state == "open"
    breaker.success()
    for _ in range(2):
        breaker.failure(now=1.0, tenant="alpha")
    breaker.failure(now=1.0)  # no connection, a timeout: the engine's, whoever asked
    assert breaker.state == "open"


def two_tenant_pool(tmp_path: Path) -> InstancePool:
    """A pool of one P and one D serving tenants alpha and beta."""
    keys = tmp_path / "keys.json"
    keys.write_text('{"sk-a-0123456789": "alpha", "sk-b-0123456789": "beta"}')
    config = load_config(
        ["--prefill", "http://p:1", "--decode", "http://d:1"],
        environ={"CARRYOVER_API_KEYS_FILE": str(keys)},
    )
    pool = InstancePool(config, cast(Upstream, None), MemoryStore(), RouterMetrics())
    return pool


def test_a_pool_blames_error_answers_on_tenants_and_transport_failures_on_the_engine(
    tmp_path: Path,
) -> None:
    pool = two_tenant_pool(tmp_path)
    decode = next(i for i in pool.instances if i.role == "decode")
    for _ in range(5):
        pool.failed(decode, EngineFailed("bad input", status=500), "alpha")
    assert decode.breaker.state == "closed"
    for _ in range(3):
        pool.failed(decode, EngineFailed("broke off"), "alpha")  # no status: engine-wide
    assert decode.breaker.state == "open"


def test_one_tenants_timed_out_legs_never_open_the_circuit_for_the_others(
    tmp_path: Path,
) -> None:
    """A P leg that runs past its deadline was taken by the engine: what the tenant sent
    (a prompt too long for ``timeouts.prefill``) may be why, so it counts as that tenant's,
    as an error answer does; a second tenant's timeouts make it the engine's."""
    pool = two_tenant_pool(tmp_path)
    prefill = next(i for i in pool.instances if i.role == "prefill")
    for _ in range(5):
        pool.failed(prefill, EngineTimeout("did not answer within 60 s"), "alpha")
    assert prefill.breaker.state == "closed"
    pool.failed(prefill, EngineTimeout("did not answer within 60 s"), "beta")
    assert prefill.breaker.state == "open"


class _Verdictless(Exception):
    pass


def pool_with_open_decode() -> tuple[InstancePool, Instance]:
    config = load_config(["--prefill", "http://p:1", "--decode", "http://d:1"], environ={})
    pool = InstancePool(config, cast(Upstream, None), MemoryStore(), RouterMetrics())
    decode = next(i for i in pool.instances if i.role == "decode")
    for _ in range(config.breaker_failures):
        decode.breaker.failure(now=-3600.0)  # open, and its reset period long over
    return pool, decode


@pytest.mark.parametrize(
    "ending",
    ["client_error", "cancelled", "handle_rejected"],
)
def test_a_trial_without_a_verdict_is_given_up_not_kept(ending: str) -> None:
    pool, decode = pool_with_open_decode()
    assert decode.available(time.monotonic())
    with contextlib.suppress(_Verdictless, asyncio.CancelledError), pool.lease(decode, "default"):
        assert decode.in_flight == 1 and decode.breaker.state == "half_open"
        assert not decode.available(time.monotonic())  # one trial at a time
        if ending == "cancelled":
            raise asyncio.CancelledError
        raise _Verdictless(ending)  # a client 4xx, or P refusing a handle: no verdict
    assert decode.in_flight == 0
    assert decode.breaker.state == "open" and decode.available(time.monotonic())


def test_a_trial_with_a_verdict_closes_or_reopens_the_circuit() -> None:
    pool, decode = pool_with_open_decode()
    with pool.lease(decode, "default") as lease:
        lease.failed(EngineFailed("still broken"))
    assert decode.breaker.state == "open" and decode.in_flight == 0
    decode.breaker.opened_at = -3600.0
    with pool.lease(decode, "default") as lease:
        lease.succeeded()
    assert decode.breaker.state == "closed" and decode.in_flight == 0


def test_a_scrape_reads_the_breaker_and_in_flight_counts_as_they_are() -> None:
    """The gauges are read when scraped (no request sets them): a scrape between any two
    events shows the state those events left."""
    config = load_config(["--prefill", "http://p:1", "--decode", "http://d:1"], environ={})
    metrics = RouterMetrics()
    pool = InstancePool(config, cast(Upstream, None), MemoryStore(), metrics)
    decode = next(i for i in pool.instances if i.role == "decode")

    def scraped(name: str) -> float:
        return parse(metrics.render().decode())[f"{name}{{server={decode.name}}}"]

    assert scraped("carryover_breaker_open") == 0
    for _ in range(config.breaker_failures):
        pool.failed(decode, EngineFailed("refused"), "default")
    assert scraped("carryover_breaker_open") == 1
    with pool.lease(decode, "default") as lease:  # the trial
        assert scraped("carryover_instance_in_flight") == 1
        lease.succeeded()
    assert scraped("carryover_instance_in_flight") == 0
    assert scraped("carryover_breaker_open") == 0
