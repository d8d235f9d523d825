"""How many non-streamed requests per second one simulated instance serves with delays off."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

from bench.overhead import _bodies, _load
from bench.procs import topology
from bench.report import percentile


def run_sim_bench(out: Path, *, requests: int, concurrency: int) -> dict[str, Any]:
    with topology() as topo:
        engine = topo.sim("engine", None, speed=0)
        topo.wait()
        url = engine.url + "/v1/completions"
        asyncio.run(_load(url, _bodies(200, conversation=False), concurrency))
        latencies, wall = asyncio.run(
            _load(url, _bodies(requests, conversation=False), concurrency)
        )
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
