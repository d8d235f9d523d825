"""The Grafana dashboard (deploy/grafana): the committed JSON is what the builder makes, and
every metric a panel queries is one the router exports, or vLLM's own."""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path
from types import ModuleType

from carryover.router.kv.metrics import KvMetrics
from carryover.router.metrics import RouterMetrics

GRAFANA = Path(__file__).parents[2] / "deploy" / "grafana"
#: Engine metrics the dashboard reads (vLLM 0.32, vllm/v1/metrics/loggers.py).
VLLM = {"vllm:inter_token_latency_seconds_bucket"}
_SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_count", "_sum"), "gauge": ("",)}


def builder() -> ModuleType:
    spec = importlib.util.spec_from_file_location("dashboard", GRAFANA / "dashboard.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def exported() -> set[str]:
    """Every sample name the router's registry can export."""
    metrics = RouterMetrics()
    KvMetrics(metrics.registry)
    return {
        family.name + suffix
        for family in metrics.registry.collect()
        for suffix in _SUFFIXES.get(family.type, ("",))
    }


def test_the_committed_dashboard_is_what_the_builder_makes() -> None:
    committed = (GRAFANA / "carryover.json").read_text()
    assert builder().render() == committed, "run: python deploy/grafana/dashboard.py > …"


def test_every_panel_queries_metrics_that_exist() -> None:
    dashboard = json.loads((GRAFANA / "carryover.json").read_text())
    names = exported()
    panels = [p for p in dashboard["panels"] if p["type"] != "row"]
    assert len(panels) >= 10
    queried: set[str] = set()
    for panel in panels:
        assert panel["targets"], panel["title"]
        assert panel["datasource"]["uid"] == "${datasource}"
        for target in panel["targets"]:
            assert target["refId"]
            queried |= set(re.findall(r"\b(carryover_[a-z_]+|vllm:[a-z_:]+)", target["expr"]))
    unknown = {name for name in queried if name not in names and name not in VLLM}
    assert not unknown, unknown
    # What operators come for: turn-N TTFT, reuse, held handles, the index's lag.
    for wanted in (
        "carryover_ttft_seconds_bucket",
        "carryover_turns_total",
        "carryover_prompt_tokens_total",
        "carryover_decode_handles",
        "carryover_kv_event_lag_seconds",
        "carryover_store_errors_total",
        "carryover_breaker_open",
    ):
        assert wanted in queried, wanted
    assert any(v["name"] == "datasource" for v in dashboard["templating"]["list"])
