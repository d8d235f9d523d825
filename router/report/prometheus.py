"""The report's samples from a Prometheus server that scrapes the routers
(``carryover report --prometheus URL``).

Two instant queries of the raw series the report reads, at the window's end and at its
start, subtracted per series with :func:`router.report.samples.delta`: the same arithmetic as
two scrapes of the routers themselves, so both sources print the same report for the same
traffic. Not PromQL's ``increase()``: that extrapolates to the window's edges and misses the
first value of a series born inside the window (a path's first turn), so its counts are
neither whole nor complete.
"""

from __future__ import annotations

import time

import httpx
import msgspec

from carryover.router.report.samples import Labels, Samples, delta
from carryover.router.report.summary import READ_COUNTERS, READ_GAUGES

__all__ = ["PrometheusError", "Window", "window"]


class PrometheusError(Exception):
    """The server refused a query (its own words) or answered something else than a vector."""


class _Series(msgspec.Struct, frozen=True):
    metric: dict[str, str]
    value: tuple[float, str]


class _Data(msgspec.Struct, frozen=True, rename="camel"):
    result_type: str
    result: list[_Series]


class _Answer(msgspec.Struct, frozen=True, rename="camel"):
    status: str
    data: _Data | None = None
    error_type: str | None = None
    error: str | None = None


class Window(msgspec.Struct, frozen=True):
    samples: Samples
    routers: int  # series of carryover_in_flight at the end: one per router replica


def selector(match: str) -> str:
    """Every series the report reads, narrowed by ``match`` (label matchers such as
    ``job="carryover"``: one Prometheus can scrape several fleets)."""
    names = "|".join(READ_COUNTERS + READ_GAUGES)
    extra = f",{match.strip().strip('{}')}" if match.strip() else ""
    return f'{{__name__=~"{names}"{extra}}}'


def instant(client: httpx.Client, url: str, query: str, at: float) -> Samples:
    """The samples of one instant query at ``at`` (Unix seconds)."""
    response = client.get(
        url.rstrip("/") + "/api/v1/query", params={"query": query, "time": f"{at:.3f}"}
    )
    try:
        answer = msgspec.json.decode(response.content, type=_Answer)
    except msgspec.DecodeError as exc:
        response.raise_for_status()
        raise PrometheusError(f"not a Prometheus answer: {response.text[:200]!r}") from exc
    if answer.status != "success" or answer.data is None:
        raise PrometheusError(f"{answer.error_type}: {answer.error}")
    if answer.data.result_type != "vector":
        raise PrometheusError(f"expected a vector, got a {answer.data.result_type}")
    samples: Samples = {}
    for series in answer.data.result:
        labels = dict(series.metric)
        name = labels.pop("__name__", "")
        key: Labels = tuple(sorted(labels.items()))
        samples[(name, key)] = float(series.value[1])
    return samples


def window(
    url: str,
    since: float,
    *,
    match: str = "",
    now: float | None = None,
    timeout: float = 10.0,
) -> Window:
    """What the routers counted in the ``since`` seconds before ``now`` (``since`` 0:
    everything since they started), as Prometheus recorded it."""
    end = time.time() if now is None else now
    query = selector(match)
    with httpx.Client(timeout=timeout) as client:
        after = instant(client, url, query, end)
        routers = sum(1 for name, _ in after if name == "carryover_in_flight")
        if since <= 0:
            return Window(after, routers)
        before = instant(client, url, query, end - since)
    return Window(delta(after, before, frozenset(READ_GAUGES)), routers)
