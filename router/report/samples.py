"""Routers' ``/metrics`` as samples: parsed, merged over replicas, and the difference of two
scrapes (what happened in between). Pure functions but ``scrape``."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import httpx
from prometheus_client.parser import text_string_to_metric_families

__all__ = ["Labels", "Samples", "delta", "merge", "parse", "scrape"]

#: A sample's labels, sorted: hashable and comparable.
Labels = tuple[tuple[str, str], ...]
#: Every sample of a scrape: (name, labels) -> value.
Samples = dict[tuple[str, Labels], float]

#: Gauges every replica reports for the whole fleet (read from the shared store): merged by
#: the largest value, not summed. Every other gauge is summed; counters and histograms too.
FLEET_GAUGES = frozenset({"carryover_decode_handles", "carryover_decode_handle_oldest_age_seconds"})
_GAUGE_TYPES = frozenset({"gauge", "unknown", "info", "stateset"})


def parse(text: str) -> tuple[Samples, frozenset[str]]:
    """The samples of one ``/metrics`` text, and the names of those that are gauges."""
    samples: Samples = {}
    gauges: set[str] = set()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels: Labels = tuple(sorted(sample.labels.items()))
            samples[(sample.name, labels)] = sample.value
            if family.type in _GAUGE_TYPES:
                gauges.add(sample.name)
    return samples, frozenset(gauges)


def merge(scrapes: Iterable[Samples]) -> Samples:
    """One fleet from several replicas: sums, but the largest value of a fleet gauge."""
    merged: Samples = {}
    for samples in scrapes:
        for key, value in samples.items():
            if key not in merged:
                merged[key] = value
            elif key[0] in FLEET_GAUGES:
                merged[key] = max(merged[key], value)
            else:
                merged[key] += value
    return merged


def delta(
    after: Samples, before: Mapping[tuple[str, Labels], float], gauges: frozenset[str]
) -> Samples:
    """What the counters and histograms counted between two scrapes; gauges as they are now.
    A counter that went down was reset (a router restarted): its value now is all it counted
    since."""
    changed: Samples = {}
    for key, value in after.items():
        if key[0] in gauges:
            changed[key] = value
            continue
        earlier = before.get(key, 0.0)
        changed[key] = value - earlier if value >= earlier else value
    return changed


def scrape(
    url: str, *, timeout: float = 10.0, admin_key: str | None = None
) -> tuple[Samples, frozenset[str]]:
    """One router's ``/metrics`` (``url`` is its base URL or the metrics URL itself);
    ``admin_key``: sent where the router keeps its metrics for operators."""
    target = url if url.rstrip("/").endswith("/metrics") else url.rstrip("/") + "/metrics"
    headers = {"Authorization": f"Bearer {admin_key}"} if admin_key else None
    response = httpx.get(target, timeout=timeout, headers=headers)
    response.raise_for_status()
    return parse(response.text)
