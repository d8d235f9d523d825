"""Reading Prometheus text as a test would: one number per metric and label set."""

from __future__ import annotations

from collections import Counter

import httpx
from prometheus_client.parser import text_string_to_metric_families


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


def by_label(values: dict[str, float], name: str, label: str) -> Counter[str]:
    """``name``'s samples summed by one label (``parse``'s keys), every other label summed
    over: ``by_label(values, "carryover_turns_total", "path")``."""
    counts: Counter[str] = Counter()
    for key, value in values.items():
        if not key.startswith(name + "{"):
            continue
        labels = dict(pair.split("=", 1) for pair in key[len(name) + 1 : -1].split(","))
        if label in labels:
            counts[labels[label]] += int(value)
    return +counts  # label values counted 0 are left out, as in a Counter of what was seen


async def turns_by_path(client: httpx.AsyncClient, router_url: str) -> Counter[str]:
    """The router's ``carryover_turns_total`` by path."""
    return by_label(await ascrape(client, router_url), "carryover_turns_total", "path")


def scrape(base_url: str) -> dict[str, float]:
    return parse(httpx.get(f"{base_url}/metrics", timeout=5).text)


async def ascrape(client: httpx.AsyncClient, base_url: str) -> dict[str, float]:
    return parse((await client.get(f"{base_url}/metrics")).text)
