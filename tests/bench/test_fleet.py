"""``carryover bench fleet`` on a tiny fleet, two arms: every turn served, no wrong answer,
and the report's prompt tokens agree with the engines' own counters (each prompt token the
client was told of is one D computed, found in its cache or pulled from P)."""

from __future__ import annotations

from pathlib import Path

import pytest

from carryover.bench.fleet import ARMS, PRESETS, run_fleet
from carryover.bench.multiturn import arm_flags
from carryover.bench.report import Slo


def test_every_fleet_arm_is_known_and_every_preset_scales() -> None:
    for arm in ARMS:
        assert arm_flags(arm) is not None, arm
    with pytest.raises(ValueError, match="vllm-router:POLICY"):
        arm_flags("vllm-router:least_busy")
    assert set(PRESETS) == {"chat", "agent", "pressure"}
    assert PRESETS["pressure"].num_blocks < PRESETS["chat"].num_blocks


def test_a_tiny_fleet_through_two_arms_agrees_with_the_engines_counters(tmp_path: Path) -> None:
    report = run_fleet(
        "chat",
        answer_tokens=16,
        arms=["carryover", "carryover-no-reuse"],
        out=tmp_path,
        slo=Slo.parse("ttft=5000ms,itl=1000ms"),
        prefills=2,
        decodes=2,
        time_scale=0.0,
        conversations=4,
        turns=3,
    )
    assert report["meta"]["workload"] == "chat" and "time_scale" in report["meta"]
    arms = report["arms"]
    for name, arm in arms.items():
        assert arm["requests"] == 12 and arm["failed"] == 0, (name, arm)
        sources = arm["prompt_tokens_per_turn"]
        told = arm["client_prompt_tokens_per_turn"]
        d_side = sum(v for k, v in sources.items() if k.startswith("decode/"))
        assert d_side == pytest.approx(told), (name, sources, told)
    assert arms["carryover"]["answers_differing_from_baseline"] == 0
    # The proxy keeps nothing: P computes or hits every token and pulls none.
    proxy = arms["carryover-no-reuse"]["prompt_tokens_per_turn"]
    assert proxy.get("prefill/external_kv_transfer", 0) == 0
    # ... and gives every turn's handle back through P: a one-token request each.
    p_side = sum(v for k, v in proxy.items() if k.startswith("prefill/"))
    told = arms["carryover-no-reuse"]["client_prompt_tokens_per_turn"]
    assert p_side == pytest.approx(told + 1)
    assert (
        arms["carryover"]["paths"].get("reuse", 0) + arms["carryover"]["paths"].get("partial", 0)
        > 0
    )
    assert "carryover-no-reuse" in report["commands"]
    # D's own gauges, sampled through the run: carryover's pins show; nothing was under
    # pressure on a fleet this empty, so nothing was given back.
    kv = report["decode_kv"]["carryover"]
    assert kv["samples"] and kv["pinned_handles_peak"] >= 1 and kv["relieved_handles"] == 0
