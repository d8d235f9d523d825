"""The churn soak's CI version (``carryover bench soak --churn --short``): under a minute of
DNS churn, DELETE floods, large tool lists and abandoned conversations, after which nothing
the router keeps or spends a turn has grown past 25% (and its line's noise floor).

Serial: its CPU and loop-lag lines are measured with nothing else on the cores."""

from __future__ import annotations

from pathlib import Path

import pytest

from carryover.bench.churn import ChurnPlan, Line, _grown, _quantile, render_churn, run_churn


def test_a_histogram_quantile_is_interpolated_within_its_bucket() -> None:
    buckets = {0.001: 50.0, 0.005: 90.0, 0.01: 100.0, float("inf"): 100.0}
    assert _quantile(buckets, 0.5) == pytest.approx(0.001)
    assert _quantile(buckets, 0.99) == pytest.approx(0.005 + 0.005 * 0.9)
    assert _quantile({}, 0.99) == 0.0


def test_a_line_grows_past_its_limit_and_its_floor_only() -> None:
    assert not _grown(Line.REDIS_KEYS, 1000, 1200, 0.25)  # within 25%
    assert not _grown(Line.REDIS_KEYS, 100, 190, 0.25)  # past 25%, within the floor of 100
    assert _grown(Line.REDIS_KEYS, 1000, 1400, 0.25)
    assert _grown(Line.REUSE_RATE, 0.9, 0.5, 0.25)  # reuse falling is what grows worse
    assert not _grown(Line.REUSE_RATE, 0.5, 0.9, 0.25)


@pytest.mark.serial
def test_under_churn_nothing_the_router_keeps_or_spends_grows(tmp_path: Path) -> None:
    report = run_churn(ChurnPlan.short(), log_dir=tmp_path)
    table = render_churn(report)
    assert report["errors"] == {}, table
    # The load happened: churn, floods and large requests, all answered.
    assert report["membership_changes"] >= 10 and report["addresses_used"] > 3, table
    assert report["deletes_of_unknown_ids"] > 1000, table
    assert report["large_turns"] >= 10, table
    assert min(report["turns_first_last_tenth"]) > 50, table
    assert report["grown"] == [], table
