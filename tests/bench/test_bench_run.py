"""A short end-to-end bench run against simulated engines: the report files and their rows."""

from __future__ import annotations

import json
from pathlib import Path

from carryover.bench.lifetimes import Lifetimes
from carryover.bench.multiturn import run_arms
from carryover.bench.report import Slo
from carryover.bench.workload import Distribution, WorkloadSpec, generate


def test_short_bench_run_writes_every_arm(tmp_path: Path) -> None:
    spec = WorkloadSpec(
        conversations=3,
        turns=3,
        system_tokens=Distribution("constant", 50),
        user_tokens=Distribution("constant", 120),
        # Long enough for a reasoning answer to close its <think> block, which the template
        # then strips from the next turn's history: one conversation of three (seed 5).
        output_tokens=Distribution("constant", 60),
        reasoning_share=0.5,
        seed=5,
    )
    arms = [
        "carryover",
        "carryover-no-reuse",
        "carryover-unchecked",
        "carryover-tokens",
        "colocated",
    ]
    report = run_arms(
        generate(spec),
        arms,
        out=tmp_path,
        slo=Slo.parse("ttft=2s"),
        speed=0.05,
        progress=False,
        prefills=1,
        decodes=1,
    )
    files = {k: Path(v) for k, v in report["files"].items()}
    assert all(path.exists() and path.stat().st_size > 0 for path in files.values())
    assert files["plot"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    data = json.loads(files["json"].read_text())
    assert set(data["arms"]) == set(arms)
    for arm in arms:
        assert sorted(int(t) for t in data["arms"][arm]["turns"]) == [1, 2, 3], data["arms"][arm]
        assert data["arms"][arm]["failed"] == 0, files["turns"].read_text()[-2000:]
    assert data["arms"]["carryover"]["answers_differing_from_baseline"] == 0
    assert data["arms"]["colocated"]["answers_differing_from_baseline"] == 0
    assert data["arms"]["carryover-tokens"]["answers_differing_from_baseline"] == 0
    # The arm without the check reuses the reasoning conversation's stripped history
    # (vLLM #43094): its answers differ, which is what the arm is there to show.
    assert data["arms"]["carryover-unchecked"]["answers_differing_from_baseline"] > 0
    for arm in ("carryover", "carryover-tokens"):  # tokens: streamed, their handles captured
        paths = data["arms"][arm]["paths"]
        reused = paths.get("reuse", 0) + paths.get("partial", 0)
        assert paths.get("cold-miss") == 3 and reused >= 4, (arm, paths)
    markdown = files["markdown"].read_text()
    for arm in arms:
        assert f"| {arm} |" in markdown
    assert len(files["turns"].read_text().splitlines()) == len(arms) * 9


def test_the_warm_arm_loads_expired_histories_from_the_shared_tier(tmp_path: Path) -> None:
    # Every pause outlasts D's TTL (6 s less vLLM's 5 s margin: a one-second record), so no
    # handle survives to the next turn; the P engines share a simulated warm tier.
    spec = WorkloadSpec(
        conversations=2,
        turns=3,
        system_tokens=Distribution("constant", 600),
        user_tokens=Distribution("constant", 40),
        output_tokens=Distribution("constant", 8),
        think_time=Distribution("constant", 1500),
        seed=7,
    )
    arms = ["carryover-warm-no-index", "carryover-no-reuse"]
    report = run_arms(
        generate(spec),
        arms,
        out=tmp_path,
        slo=Slo.parse("ttft=2s"),
        speed=0.05,
        progress=False,
        prefills=2,
        decodes=1,
        lifetimes=Lifetimes(6),
        # No prefix cache on the engines (as after eviction): which P a turn lands on cannot
        # decide what it computes; only the tier can spare P the history.
        sim_flags=("--no-enable-prefix-caching",),
    )
    data = json.loads(Path(report["files"]["json"]).read_text())
    warm = data["arms"]["carryover-warm-no-index"]
    assert warm["failed"] == 0 and warm["answers_differing_from_baseline"] == 0
    assert warm["paths"] == {"cold-miss": 2, "warm": 4}, warm["paths"]
    # What P did not compute, it loaded from the tier (no handle was ever pulled).
    tokens = warm["prompt_tokens_per_turn"]
    cold = data["arms"]["carryover-no-reuse"]["prompt_tokens_per_turn"]
    assert tokens["prefill/local_cache_hit"] == cold["prefill/local_cache_hit"] == 0
    assert tokens["prefill/external_kv_transfer"] > 0
    assert tokens["prefill/local_compute"] < cold["prefill/local_compute"]
