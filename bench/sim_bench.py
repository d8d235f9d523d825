"""How many non-streamed requests per second one simulated instance serves with delays off."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

from carryover.bench.loadgen import closed_loop
from carryover.bench.overhead import jobs_for
from carryover.bench.procs import topology
from carryover.bench.report import percentile


def run_sim_bench(out: Path, *, requests: int, concurrency: int) -> dict[str, Any]:
    with topology() as topo:
        engine = topo.sim("engine", None, speed=0)
        topo.wait()
        warm = jobs_for("completions", 200, conversation=False)
        asyncio.run(closed_loop(engine.url, warm, concurrency))
        jobs = jobs_for("completions", requests, conversation=False)
        samples, wall = asyncio.run(closed_loop(engine.url, jobs, concurrency))
        latencies = [s.latency for s in samples]
    result = {
        "requests": requests,
        "concurrency": concurrency,
        "requests_per_s": requests / wall,
        "p50_ms": percentile(latencies, 50) * 1000,
        "p99_ms": percentile(latencies, 99) * 1000,
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / "sim.json").write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))
    return result
