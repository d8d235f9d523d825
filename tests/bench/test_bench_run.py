"""A short end-to-end bench run against simulated engines: the report files and their rows."""

from __future__ import annotations

import json
from pathlib import Path

from bench.multiturn import run_arms
from bench.report import Slo
from bench.workload import Distribution, WorkloadSpec, generate


def test_short_bench_run_writes_every_arm(tmp_path: Path) -> None:
    spec = WorkloadSpec(
        conversations=3,
        turns=3,
        system_tokens=Distribution("constant", 50),
        user_tokens=Distribution("constant", 120),
        output_tokens=Distribution("constant", 12),
        reasoning_share=0.34,
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
    for arm in ("carryover", "carryover-tokens"):  # tokens: streamed, their handles captured
        paths = data["arms"][arm]["paths"]
        reused = paths.get("reuse", 0) + paths.get("partial", 0)
        assert paths.get("cold-miss") == 3 and reused >= 4, (arm, paths)
    markdown = files["markdown"].read_text()
    for arm in arms:
        assert f"| {arm} |" in markdown
    assert len(files["turns"].read_text().splitlines()) == len(arms) * 9
