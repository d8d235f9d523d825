"""Reading Prometheus text as a test would: one number per metric and label set."""

from __future__ import annotations

from collections import Counter

import httpx
from prometheus_client.parser import text_string_to_metric_families

from carryover.router.report.samples import parse as parse_samples
from carryover.router.report.summary import summarize
from tests.support.waiting import eventually


def parse(text: str) -> dict[str, float]:
    """``{"name{label=value,...}": value}`` with labels sorted (model and engine left out);
    ``name:sum`` adds up every label set of a metric."""
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(
                f"{k}={v}"
                for k, v in sorted(sample.labels.items())
                if k not in ("model_name", "engine")
            )
            values[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
            values[f"{sample.name}:sum"] = values.get(f"{sample.name}:sum", 0.0) + sample.value
    return values


#: The admin key of the tests' routers that have api keys: their ``/metrics`` answers it
#: only (docs/operations.md). Every scrape sends it; engines and open routers ignore it.
OPERATOR_KEY = "sk-operator-7d41c0b9e2"
_OPERATOR = {"Authorization": f"Bearer {OPERATOR_KEY}"}


async def turns_by_path(client: httpx.AsyncClient, router_url: str) -> Counter[str]:
    """The router's turns by path, as ``carryover report`` reads them from its ``/metrics``."""
    text = (await client.get(f"{router_url}/metrics", headers=_OPERATOR)).text
    samples, _ = parse_samples(text)
    return Counter(summarize(samples, window_s=None, routers=1).turns_by_path)


def scrape(base_url: str) -> dict[str, float]:
    return parse(_read(httpx.get(f"{base_url}/metrics", timeout=5, headers=_OPERATOR)))


async def ascrape(client: httpx.AsyncClient, base_url: str) -> dict[str, float]:
    return parse(_read(await client.get(f"{base_url}/metrics", headers=_OPERATOR)))


def _read(response: httpx.Response) -> str:
    assert response.status_code == 200, f"{response.request.url}: {response.status_code}"
    return response.text


def ledger_open(values: dict[str, float]) -> float:
    """Handles a router holds whose fate is not settled: what it took (held) less what
    ended (fates); nonzero on an idle router is a leak (router/handles/ledger.py)."""
    held = values.get("carryover_handles_held_total:sum", 0.0)
    ended = values.get("carryover_handle_fates_total:sum", 0.0)
    return held - ended


async def assert_ledger_balanced(client: httpx.AsyncClient, router_url: str) -> None:
    """Once the router is idle, every handle it held has its one final state."""
    values = await eventually(
        lambda: ascrape(client, router_url),
        lambda v: ledger_open(v) == 0 and v.get("carryover_handles_open", 0.0) == 0,
        what=f"every handle {router_url} held settled",
    )
    assert values.get("carryover_handle_ledger_errors_total", 0.0) == 0
