"""A short overhead run: every arm and mode gets a row (the median of its rounds), a peer
given as a command is started and measured with its own CPU, and the peer option's forms
parse."""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

import pytest

from carryover.bench.overhead import Peer, parse_peer, run_overhead

MODES = ("completions", "stream", "chat")


def test_peer_forms() -> None:
    assert parse_peer("vllm-router=http://127.0.0.1:9000/") == Peer(
        "vllm-router", url="http://127.0.0.1:9000"
    )
    assert parse_peer("x=run --port {port}") == Peer("x", command="run --port {port}")
    with pytest.raises(ValueError, match="NAME=URL"):
        parse_peer("http://127.0.0.1:9000")


def test_short_overhead_run_measures_every_arm_and_a_peer(tmp_path: Path) -> None:
    # carryover itself stands in for a peer router: started from the command, without state.
    command = (
        f"{sys.executable} -m carryover serve --port {{port}} --prefill {{prefill}} "
        "--decode {decode} --log-level warning"
    )
    results = run_overhead(
        tmp_path,
        requests=(24,),
        concurrency=(2,),
        peers=[Peer("again", command=command)],
        workers=(1, 2),
        rounds=2,
    )
    arms = ["carryover", "carryover-redis", "carryover-redis-w2", "again"]
    rows = {(r["arm"], r["mode"]): r for r in results["rows"]}
    assert set(rows) == {(arm, mode) for arm in arms for mode in MODES}
    for row in rows.values():
        assert row["turns"] == 24 and row["turns_per_s"] > 0 and row["rounds"] == 2
        assert row["cpu_s_per_1000_turns"] >= 0
    # The kernel counts CPU in clock ticks (10 ms here): a few dozen turns of one mode can
    # fall between two ticks, all of an arm's modes cannot. The peer's tree is measured too.
    for arm in arms:
        assert sum(rows[(arm, mode)]["cpu_s_per_1000_turns"] for mode in MODES) > 0, arm
    memory = {m["arm"]: m for m in results["memory"]}
    assert all(memory[arm]["rss_rest_mb"] > 0 for arm in arms)
    written = json.loads((tmp_path / "overhead.json").read_text())
    assert written["peers"] == ["again"]
    # Every arm ran once per round; each reported figure is the median of its rounds'.
    per_round = [r for r in written["round_rows"] if r["arm"] == "again" and r["mode"] == "chat"]
    assert sorted(r["round"] for r in per_round) == [0, 1]
    medians = statistics.median(r["router_p50_us"] for r in per_round)
    assert rows[("again", "chat")]["router_p50_us"] == pytest.approx(medians)
    report = (tmp_path / "overhead.md").read_text()
    assert "median of 2 rounds" in report
    assert "carryover against again" in report and "CPU per turn at concurrency 2" in report
