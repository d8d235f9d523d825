"""The report's arithmetic (router/report): quantiles from buckets, replicas merged, two
scrapes subtracted."""

from __future__ import annotations

import argparse
import math

import pytest

from carryover.router.report.cli import parse_duration
from carryover.router.report.samples import delta, merge, parse
from carryover.router.report.summary import markdown, quantile, summarize

INF = math.inf


def test_quantiles_interpolate_within_the_bucket_as_prometheus_does() -> None:
    buckets = [(0.1, 0.0), (0.2, 10.0), (0.5, 20.0), (INF, 20.0)]
    assert quantile(0.5, buckets) == pytest.approx(0.2)
    assert quantile(0.25, buckets) == pytest.approx(0.15)
    assert quantile(0.99, buckets) == pytest.approx(0.2 + 0.3 * 9.8 / 10)
    # Ranks past the last finite bound: that bound is all that can be said.
    assert quantile(0.99, [(0.1, 1.0), (INF, 10.0)]) == pytest.approx(0.1)
    assert quantile(0.5, [(0.1, 0.0), (INF, 0.0)]) is None


TEXT = """\
# TYPE carryover_turns_total counter
carryover_turns_total{model="m",path="reuse"} 6
carryover_turns_total{model="m",path="cold-miss"} 3
# TYPE carryover_decode_handles gauge
carryover_decode_handles{server="d0"} 3
# TYPE carryover_in_flight gauge
carryover_in_flight 1
# TYPE carryover_ttft_seconds histogram
carryover_ttft_seconds_bucket{le="0.1",turn="1"} 1
carryover_ttft_seconds_bucket{le="0.2",turn="1"} 3
carryover_ttft_seconds_bucket{le="+Inf",turn="1"} 3
carryover_ttft_seconds_count{turn="1"} 3
carryover_ttft_seconds_sum{turn="1"} 0.4
"""


def test_replicas_add_up_but_fleet_gauges_are_not_counted_twice() -> None:
    one, gauges = parse(TEXT)
    assert "carryover_decode_handles" in gauges and "carryover_turns_total" not in gauges
    merged = merge([one, one])
    report = summarize(merged, window_s=None, routers=2)
    assert report.turns_by_path == {"cold-miss": 6, "reuse": 12}
    assert report.decode_held["d0"].handles == 3  # every replica reads the same store
    assert merged[("carryover_in_flight", ())] == 2  # each replica's own: summed
    assert [r.count for r in report.ttft] == [6]


def test_two_scrapes_give_what_happened_between_them_and_survive_a_restart() -> None:
    before, _ = parse(TEXT)
    after, gauges = parse(
        TEXT.replace('path="reuse"} 6', 'path="reuse"} 10').replace(
            'path="cold-miss"} 3',
            'path="cold-miss"} 1',  # a restarted router counts anew
        )
    )
    report = summarize(delta(after, before, gauges), window_s=60, routers=1)
    assert report.turns_by_path == {"cold-miss": 1, "reuse": 4}
    assert report.ttft == []  # no streamed turn in the window
    assert report.decode_held["d0"].handles == 3  # a gauge is read as it is now
    assert "over the last 60 s" in markdown(report)


def test_durations() -> None:
    durations = ("90", "30s", "15m", "1h", "1d", "0")
    assert [parse_duration(t) for t in durations] == [90, 30, 900, 3600, 86400, 0]
    with pytest.raises(argparse.ArgumentTypeError):
        parse_duration("soon")
