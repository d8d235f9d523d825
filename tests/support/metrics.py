"""Reading Prometheus text as a test would: one number per metric and label set."""

from __future__ import annotations

from collections import Counter

import httpx
from prometheus_client.parser import text_string_to_metric_families

from router.report.samples import parse as parse_samples
from router.report.summary import summarize


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


async def turns_by_path(client: httpx.AsyncClient, router_url: str) -> Counter[str]:
    """The router's turns by path, as ``carryover report`` reads them from its ``/metrics``."""
    samples, _ = parse_samples((await client.get(f"{router_url}/metrics")).text)
    return Counter(summarize(samples, window_s=None, routers=1).turns_by_path)


def scrape(base_url: str) -> dict[str, float]:
    return parse(httpx.get(f"{base_url}/metrics", timeout=5).text)


async def ascrape(client: httpx.AsyncClient, base_url: str) -> dict[str, float]:
    return parse((await client.get(f"{base_url}/metrics")).text)
