from __future__ import annotations

import json
from pathlib import Path

import pytest

from carryover.bench import multiturn
from carryover.bench.multiturn import ArmResult, arm_flags
from carryover.bench.report import (
    Slo,
    answers_differing,
    build_report,
    lag_summary,
    percentile,
    render_markdown,
)
from carryover.bench.runner import TurnRecord


def test_percentile_matches_linear_interpolation() -> None:
    assert percentile([1, 2, 3, 4], 50) == 2.5
    assert percentile([10], 99) == 10
    assert percentile([0, 10], 90) == pytest.approx(9.0)
    assert percentile(list(range(101)), 99) == pytest.approx(99.0)
    with pytest.raises(ValueError):
        percentile([], 50)


def rec(
    arm: str,
    conv: str,
    turn: int,
    ttft: float,
    answer: str = "a",
    itl: list[float] | None = None,
    path: str | None = "reuse",
    status: int = 200,
) -> TurnRecord:
    return TurnRecord(arm, conv, turn, status, ttft, itl or [0.01], ttft + 0.1, path, answer)


def test_report_math() -> None:
    records = [
        rec("base", "c1", 1, 0.100, "x"),
        rec("base", "c1", 2, 0.300, "y"),
        rec("base", "c2", 1, 0.200, "z"),
        rec("fast", "c1", 1, 0.100, "x"),
        rec("fast", "c1", 2, 0.110, "DIFFERENT"),
        rec("fast", "c2", 1, 0.300, "z", itl=[0.2]),
        rec("fast", "c2", 2, 0.0, "", status=500),
    ]
    records[-1].error = "boom"
    report = build_report(
        records,
        baseline_arm="base",
        slo=Slo.parse("ttft=250ms,itl=50ms"),
        wall_seconds={"base": 2.0, "fast": 4.0},
    )
    base, fast = report["arms"]["base"], report["arms"]["fast"]
    assert base["turns"][1]["ttft_p50_ms"] == pytest.approx(150)
    assert base["turns"][2]["ttft_p50_ms"] == pytest.approx(300)
    assert base["ratio_last_turn1"] == pytest.approx(2.0)
    assert fast["turns"][1]["ttft_p50_ms"] == pytest.approx(200)
    assert fast["ratio_last_turn1"] == pytest.approx(0.55)
    assert fast["ratio_turn5_turn1"] is None
    assert fast["answers_differing_from_baseline"] == 1
    assert base["answers_differing_from_baseline"] is None
    assert fast["failed"] == 1 and fast["requests"] == 4
    # Good turns: fast c1 t1 and c1 t2 (c2's TTFT and ITL are over, the last one failed).
    assert fast["goodput_share"] == pytest.approx(0.5) and fast["goodput_per_s"] == pytest.approx(
        0.5
    )
    assert base["goodput_share"] == pytest.approx(2 / 3)
    text = render_markdown(report)
    assert "| 1 | 150 / 199 | 200 / 298 |" in text and "| fast |" in text


def test_a_conversation_counts_once_up_to_its_first_differing_answer() -> None:
    """Later turns carry each arm's own answers, so they differ without being wrong; a turn
    the baseline did not answer ends the comparison."""
    baseline = {("c1", 1): "x", ("c1", 2): "y", ("c1", 3): "z", ("c2", 1): "p", ("c3", 1): "q"}
    answered = [
        rec("fast", "c1", 1, 0.1, "x"),
        rec("fast", "c1", 2, 0.1, "Y"),  # the first difference: counted
        rec("fast", "c1", 3, 0.1, "Z"),  # after it: another history, not counted
        rec("fast", "c2", 1, 0.1, "p"),
        rec("fast", "c2", 2, 0.1, "other"),  # the baseline has no turn 2 here
        rec("fast", "c3", 1, 0.1, "q"),
    ]
    assert answers_differing(answered, baseline) == 1


def test_slo_parsing() -> None:
    slo = Slo.parse("ttft=2s,itl=50ms")
    assert (slo.ttft, slo.itl) == (2.0, 0.05)
    with pytest.raises(ValueError):
        Slo.parse("latency=1s")


def test_prompt_tokens_are_reported_per_answered_turn() -> None:
    records = [rec("a", "c1", 1, 0.1), rec("a", "c1", 2, 0.1), rec("b", "c1", 1, 0.1)]
    sources = {
        "a": {"prefill/local_compute": 300.0, "decode/external_kv_transfer": 100.0},
        "b": {"colocated/local_compute": 50.0},
    }
    report = build_report(
        records, baseline_arm=None, slo=Slo.parse(None), wall_seconds={}, sources=sources
    )
    assert report["arms"]["a"]["prompt_tokens_per_turn"] == {
        "decode/external_kv_transfer": 50.0,
        "prefill/local_compute": 150.0,
    }
    table = render_markdown(report)
    assert "| arm | P computed | D pulled from P | computed (colocated) |" in table
    assert "| a | 150 | 50 | 0 |" in table and "| b | 0 | 0 | 50 |" in table


def test_decode_local_arms_take_their_threshold_from_the_name() -> None:
    assert arm_flags("carryover-decode-local:128") == ["--decode-local-max-tokens", "128"]
    assert arm_flags("carryover-tokens-per-load:64") == ["--affinity-tokens-per-load", "64"]
    assert arm_flags("carryover-affinity-slack:1") == ["--affinity-slack", "1"]
    assert arm_flags("carryover-tokens:0.02")[-2:] == ["--stream-interval", "0.02"]
    assert arm_flags("carryover-no-reuse") == ["--no-reuse"]
    assert arm_flags("colocated") is None
    with pytest.raises(ValueError):
        arm_flags("carryover:12")


def test_a_run_stopped_in_an_arm_keeps_the_report_of_the_arms_before(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def arm_or_hang(arm: str, conversations: object, **_: object) -> ArmResult:
        if arm != "carryover":
            raise RuntimeError("an engine stopped answering")
        return ArmResult([rec(arm, "c1", 1, 0.05)], 1.0, {"prefill/local_compute": 10.0})

    monkeypatch.setattr(multiturn, "_run_sim_arm", arm_or_hang)
    with pytest.raises(RuntimeError):
        multiturn.run_arms(
            [], ["carryover", "carryover-no-reuse"], out=tmp_path, slo=Slo(), progress=False
        )
    report = json.loads((tmp_path / "report.json").read_text())
    assert list(report["arms"]) == ["carryover"]
    assert (tmp_path / "report.md").read_text().count("| carryover |") >= 1


def test_a_loops_lag_is_summarized_in_milliseconds() -> None:
    assert lag_summary([]) is None
    late = lag_summary([0.0, 0.001, 0.002, 0.1])
    assert late is not None
    assert late["max_ms"] == pytest.approx(100.0)
    assert late["p50_ms"] == pytest.approx(1.5)
    assert late["mean_ms"] == pytest.approx(25.75)
