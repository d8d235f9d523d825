"""``carryover bench fleet`` on a tiny fleet, two arms: every turn served, no wrong answer,
and the report's prompt tokens agree with the engines' own counters (each prompt token the
client was told of is one D computed, found in its cache or pulled from P)."""

from __future__ import annotations

import gc
import json
import os
from pathlib import Path

import pytest

from carryover.bench.fleet import ARMS, PRESETS, run_fleet
from carryover.bench.lifetimes import Lifetimes
from carryover.bench.multiturn import arm_flags
from carryover.bench.report import Slo
from carryover.bench.sim.config import parse_sim_args
from carryover.bench.workload import WorkloadSpec, generate
from carryover.router.config.load import load_config


def test_every_fleet_arm_is_known_and_every_preset_scales() -> None:
    for arm in ARMS:
        assert arm_flags(arm) is not None, arm
    with pytest.raises(ValueError, match="vllm-router:POLICY"):
        arm_flags("vllm-router:least_busy")
    assert set(PRESETS) == {"chat", "agent", "pressure"}
    assert PRESETS["pressure"].num_blocks < PRESETS["chat"].num_blocks


def test_scaled_time_keeps_a_handle_usable_for_the_same_share_of_ds_ttl() -> None:
    # At 0.02 D's 480 s is 9.6 s: P's 5 s margin scales too, or it takes half of the TTL
    # (a handle then read 230 s of think time after its turn, not 475 s).
    lifetimes = Lifetimes.scaled(PRESETS["chat"].decode_ttl, 0.02)
    transfer = {
        "kv_connector": "NixlConnector",
        "kv_role": "kv_consumer",
        "kv_connector_extra_config": lifetimes.decode_config(),
    }
    decode = parse_sim_args(
        ["sim-qwen3", *lifetimes.engine_flags(), "--kv-transfer-config", json.dumps(transfer)]
    )
    readable = decode.extra.decoder_kv_blocks_ttl - decode.expiry_margin
    assert readable == pytest.approx((480 - 5) * 0.02)
    router = load_config(["--decode", "http://d:1", *lifetimes.router_flags()], environ={})
    assert router.models[0].record_ttl == pytest.approx(readable)


def test_conversations_have_turns_in_their_range_and_agents_send_tool_results() -> None:
    chat = generate(WorkloadSpec(conversations=200, turns=8, max_turns=20, seed=3))
    lengths = {len(c.users) for c in chat}
    assert min(lengths) == 8 and max(lengths) == 20
    agent = generate(WorkloadSpec(conversations=2, turns=3, tool_results=True, stream=False))
    assert all(c.tool_results and not c.stream for c in agent)


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
    # The load generator froze its heap through each arm, and left nothing frozen.
    assert gc.get_freeze_count() == 0
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
    assert _used_the_conversation(arms["carryover"]["paths"])
    assert "carryover-no-reuse" in report["commands"]
    # D's own gauges, sampled through the run: carryover's pins show; nothing was under
    # pressure on a fleet this empty, so nothing was given back.
    kv = report["decode_kv"]["carryover"]
    assert kv["samples"] and kv["pinned_handles_peak"] >= 1
    assert kv["relieved_handles"] == 0 and kv["pins_not_kept"] == 0
    # The router's retries by its own count: every turn's first attempt held.
    assert report["router_retries"]["carryover"] == {}
    assert "cold-error" not in arms["carryover"]["paths"]


def test_an_agent_fleet_answers_whole_turns_of_tool_results(tmp_path: Path) -> None:
    # Through two workers sharing state in the arm's own Redis, on engines at a lower
    # priority: a conversation's turns meet their handles whichever worker takes them. The
    # routers run on a CPU of their own where there are two.
    cpus = sorted(os.sched_getaffinity(0))
    router_cpus = frozenset(cpus[-1:]) if len(cpus) > 1 else frozenset()
    report = run_fleet(
        "agent",
        answer_tokens=16,
        arms=["carryover-workers", "carryover-no-reuse"],
        out=tmp_path,
        slo=Slo.parse("ttft=5000ms"),
        prefills=1,
        decodes=1,
        time_scale=0.0,
        conversations=2,
        turns=3,
        engine_nice=10,
        router_cpus=router_cpus,
    )
    for name, arm in report["arms"].items():
        assert arm["requests"] == 6 and arm["failed"] == 0, (name, arm)
        assert arm["itl_p50_ms"] is None  # answered whole: nothing streamed
    workers = report["arms"]["carryover-workers"]
    assert workers["answers_differing_from_baseline"] == 0
    assert _used_the_conversation(workers["paths"])
    assert "--workers 2 --redis redis://" in report["commands"]["carryover-workers"]
    assert report["meta"]["engine_nice"] == 10
    # Each router's process tree (the two workers included) ran where it was placed, and
    # its CPU over the run is reported.
    for arm in ("carryover-workers", "carryover-no-reuse"):
        cpu = report["router_cpu"][arm]
        assert cpu["cpus"] == sorted(router_cpus or cpus), arm
        assert cpu["cpu_seconds"] > 0 and cpu["per_turn_ms"] > 0, (arm, cpu)
        assert report["commands"][arm].startswith("taskset") == bool(router_cpus)
    markdown = Path(report["files"]["markdown"]).read_text()
    assert "## Each arm's router: CPU over the run" in markdown
    # So is the simulated engines' CPU, by role: both served every turn.
    for arm in ("carryover-workers", "carryover-no-reuse"):
        used = report["engine_cpu"][arm]
        assert set(used) == {"prefill", "decode"}, (arm, used)
        assert all(u["per_turn_ms"] > 0 and u["core_share"] > 0 for u in used.values()), used
    assert "## The simulated engines' CPU" in markdown
    # Where each carryover arm's turns spent their time, by the router's own histogram.
    for arm in ("carryover-workers", "carryover-no-reuse"):
        legs = report["router_legs"][arm]
        assert legs["prefill"] > 0 and legs["decode"] > 0 and legs["loop lag"] >= 0, (arm, legs)
        # The load generator watched its own loop through the arm.
        late = report["client_lag"][arm]
        assert late["max_ms"] >= late["p50_ms"] >= 0
        # ... and its collector's passes, one cause of such lag (a run this short may make none).
        assert late["gc_ms"] >= late["gc_max_ms"] >= 0 and late["full_passes"] >= 0


def _used_the_conversation(paths: dict[str, int]) -> bool:
    """Later turns found the stored handle: pulled it, or gave it back where P's own cache
    held all but the last short answer (docs/turn-costs.md)."""
    return sum(paths.get(p, 0) for p in ("reuse", "partial", "prefill-cache")) > 0
