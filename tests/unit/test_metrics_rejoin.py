"""An instance that leaves discovery takes its series with it, and one that comes back under
the same name reports again: under DNS churn the label children stay as many as the fleet."""

from __future__ import annotations

from carryover.router.metrics import RouterMetrics
from tests.support.metrics import parse


def _series(metrics: RouterMetrics, server: str) -> dict[str, float]:
    return {k: v for k, v in parse(metrics.render().decode()).items() if f"server={server}" in k}


def test_a_departed_instances_series_go_and_come_back_when_it_returns() -> None:
    metrics = RouterMetrics()
    metrics.instance_up("d1:8000", "decode", True)
    metrics.held.labels("d1:8000").set(5)
    metrics.held_oldest.labels("d1:8000").set(30.0)
    metrics.draining.labels("d1:8000").set(0)
    assert _series(metrics, "d1:8000")["carryover_decode_handles{server=d1:8000}"] == 5
    metrics.forget_instance("d1:8000")
    assert _series(metrics, "d1:8000") == {}  # held handles too: no last value left behind
    # Back under the same name: its series report again.
    metrics.instance_up("d1:8000", "decode", True)
    metrics.held.labels("d1:8000").set(2)
    back = _series(metrics, "d1:8000")
    assert back["carryover_instance_up{role=decode,server=d1:8000}"] == 1
    assert back["carryover_decode_handles{server=d1:8000}"] == 2


def test_churn_leaves_only_the_present_instances_children() -> None:
    metrics = RouterMetrics()
    for n in range(500):
        name = f"10.0.{n // 250}.{n % 250}:8000"
        metrics.instance_up(name, "decode", True)
        metrics.held.labels(name).set(n)
        metrics.breaker_open.labels(name).set(0)
        if n < 499:
            metrics.forget_instance(name)
    servers = {
        k.split("server=")[1].rstrip("}").split(",")[0]
        for k in parse(metrics.render().decode())
        if "server=" in k
    }
    assert servers == {"10.0.1.249:8000"}
