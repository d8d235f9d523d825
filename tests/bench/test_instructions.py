"""``carryover bench instructions``: a short run counts the router's instructions per turn
and leaves no process behind."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from carryover.bench.instructions import run_instructions


def test_a_short_run_counts_instructions_per_turn(tmp_path: Path) -> None:
    results = run_instructions(tmp_path, modes=["stream"], turns=5)
    [row] = results["rows"]
    assert row["mode"] == "stream" and row["turns"] == 5
    # A turn is three HTTP exchanges, a claim, a plan and a commit: hundreds of thousands of
    # instructions, not a handful (a dump taken with instrumentation off counts nothing).
    assert 100_000 < row["instructions_per_turn"] < 50_000_000
    assert json.loads((tmp_path / "instructions.json").read_text()) == results
    assert "| stream | 5 |" in (tmp_path / "instructions.md").read_text()
    # The router under valgrind is gone with the run.
    left = subprocess.run(["pgrep", "-f", f"callgrind-out-file={tmp_path}"], capture_output=True)
    assert left.returncode == 1, left.stdout
