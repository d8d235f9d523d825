"""Router overhead: the same requests direct to a zero-delay simulated engine and through the
router (P leg + D leg + claim + commit), as vLLM's router documents its overhead numbers.

Reports ``mean_minus_direct`` (µs), p50/p99 latency, router CPU seconds per 1,000 turns and peak
RSS of the router's processes, at concurrency 1 and 64.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import aiohttp

from bench.procs import Process, topology
from bench.report import percentile

__all__ = ["run_overhead"]

_TICKS = os.sysconf("SC_CLK_TCK")


def _tree(pid: int) -> list[int]:
    pids = [pid]
    for task in Path(f"/proc/{pid}/task").iterdir():
        children = (task / "children").read_text().split()
        for child in children:
            pids += _tree(int(child))
    return pids


def _cpu_seconds(pid: int) -> float:
    total = 0
    for p in _tree(pid):
        fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
        total += int(fields[11]) + int(fields[12])  # utime + stime
    return total / _TICKS


def _peak_rss_mb(pid: int) -> float:
    peak = 0
    for p in _tree(pid):
        for line in Path(f"/proc/{p}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                peak = max(peak, int(line.split()[1]))
    return peak / 1024


async def _load(
    url: str, bodies: list[dict[str, Any]], concurrency: int
) -> tuple[list[float], float]:
    latencies: list[float] = []
    queue = list(reversed(bodies))
    connector = aiohttp.TCPConnector(limit=concurrency * 2)
    async with aiohttp.ClientSession(connector=connector) as session:

        async def worker() -> None:
            while queue:
                body = queue.pop()
                started = time.perf_counter()
                async with session.post(url, json=body) as response:
                    await response.read()
                    if response.status != 200:
                        raise RuntimeError(f"{url} answered {response.status}")
                latencies.append(time.perf_counter() - started)

        started = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return latencies, time.perf_counter() - started


def _bodies(count: int, *, conversation: bool) -> list[dict[str, Any]]:
    prompt = list(range(1000, 1128))
    bodies = []
    for _ in range(count):
        body: dict[str, Any] = {
            "model": "sim-qwen3",
            "prompt": prompt,
            "max_tokens": 4,
            "ignore_eos": True,
        }
        if conversation:
            body["conversation_id"] = uuid.uuid4().hex
        bodies.append(body)
    return bodies


def run_overhead(
    out: Path, *, requests: Sequence[int] = (400, 3000), concurrency: Sequence[int] = (1, 64)
) -> dict[str, Any]:
    results: dict[str, Any] = {
        "method": "same completions request (128-token id prompt, 4 output tokens) "
        "direct to one zero-delay engine vs through the router; each routed "
        "request is a new conversation turn (claim miss + commit)"
    }
    with topology() as topo:
        direct = topo.sim("direct", None, speed=0)
        p = topo.sim("prefill", "kv_producer", speed=0)
        d = topo.sim("decode", "kv_consumer", speed=0)
        router: Process = topo.router("router", [p], [d])
        topo.wait()
        path = "/v1/completions"
        for conc, count in zip(concurrency, requests, strict=True):
            asyncio.run(_load(direct.url + path, _bodies(50, conversation=False), conc))  # warm up
            asyncio.run(_load(router.url + path, _bodies(50, conversation=True), conc))
            direct_lat, direct_wall = asyncio.run(
                _load(direct.url + path, _bodies(count, conversation=False), conc)
            )
            cpu_before = _cpu_seconds(router.popen.pid)
            routed_lat, routed_wall = asyncio.run(
                _load(router.url + path, _bodies(count, conversation=True), conc)
            )
            cpu = _cpu_seconds(router.popen.pid) - cpu_before
            mean_direct = sum(direct_lat) / len(direct_lat)
            mean_routed = sum(routed_lat) / len(routed_lat)
            results[f"concurrency_{conc}"] = {
                "requests": count,
                "direct_mean_us": mean_direct * 1e6,
                "router_mean_us": mean_routed * 1e6,
                "mean_minus_direct_us": (mean_routed - mean_direct) * 1e6,
                "router_p50_us": percentile(routed_lat, 50) * 1e6,
                "router_p99_us": percentile(routed_lat, 99) * 1e6,
                "direct_p50_us": percentile(direct_lat, 50) * 1e6,
                "direct_p99_us": percentile(direct_lat, 99) * 1e6,
                "router_turns_per_s": count / routed_wall,
                "direct_requests_per_s": count / direct_wall,
                "router_cpu_s_per_1000_turns": cpu / count * 1000,
            }
        results["router_peak_rss_mb"] = _peak_rss_mb(router.popen.pid)
    out.mkdir(parents=True, exist_ok=True)
    (out / "overhead.json").write_text(json.dumps(results, indent=2))
    lines = [
        "# Router overhead (zero-delay simulated engines)",
        "",
        results["method"],
        "",
        "| concurrency | mean - direct (µs) | router p50 / p99 (µs) | direct p50 / p99 (µs) | turns/s | CPU s / 1k turns |",
        "|---|---|---|---|---|---|",
    ]
    for conc in concurrency:
        r = results[f"concurrency_{conc}"]
        lines.append(
            f"| {conc} | {r['mean_minus_direct_us']:.0f} | {r['router_p50_us']:.0f} / {r['router_p99_us']:.0f} "
            f"| {r['direct_p50_us']:.0f} / {r['direct_p99_us']:.0f} | {r['router_turns_per_s']:.0f} "
            f"| {r['router_cpu_s_per_1000_turns']:.2f} |"
        )
    lines += ["", f"Router peak RSS: {results['router_peak_rss_mb']:.0f} MB", ""]
    (out / "overhead.md").write_text("\n".join(lines))
    print("\n".join(lines))
    return results
