"""What a cache salt per tenant costs when tenants share a long system prompt.

Every arm runs on fresh simulated engines (P and D with prefix caching): ``tenants`` tenants,
each with ``per_tenant`` first turns (one conversation each) that start with the same
``system_tokens`` system prompt and go on with a short question of their own. The arms:

* ``salted``: the default, a salt per tenant: each tenant's P computes the system prompt
  once, then hits it;
* ``shared``: ``--shared-cache``: every tenant hits the first tenant's blocks.

Reported per arm: time to first token (p50, p90) of the first turns and the prompt tokens P
computed and found cached, by P's own counters.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx

from carryover.bench.fleet_counters import engine_prompt_sources
from carryover.bench.procs import topology

__all__ = ["ARMS", "run_tenant_salt"]

ARMS = {"salted": [], "shared": ["--shared-cache"]}

_WORD = "policy "  # one token of the simulated Qwen3 tokenizer per word, about


async def _turns(
    url: str, keys: Sequence[str], per_tenant: int, system: str, model: str
) -> list[float]:
    """First turns, tenants interleaved, one at a time (TTFT without queueing)."""
    ttfts: list[float] = []
    async with httpx.AsyncClient(timeout=120) as client:
        for n in range(per_tenant):
            for t, key in enumerate(keys):
                body = {
                    "model": model,
                    "stream": True,
                    "max_tokens": 4,
                    "messages": [
                        {"role": "system", "content": system},
                        {"role": "user", "content": f"Question {n} of tenant {t}: which rule?"},
                    ],
                    "conversation_id": f"t{t}-c{n}",
                }
                headers = {"Authorization": f"Bearer {key}"}
                started = time.perf_counter()
                async with client.stream(
                    "POST", f"{url}/v1/chat/completions", json=body, headers=headers
                ) as response:
                    response.raise_for_status()
                    first = True
                    async for line in response.aiter_lines():
                        if first and line.startswith("data: "):
                            ttfts.append(time.perf_counter() - started)
                            first = False
    return ttfts


def _arm(
    flags: list[str], *, tenants: int, per_tenant: int, system_tokens: int, speed: float
) -> dict[str, Any]:
    keys = [f"sk-bench-tenant-{t:03d}" for t in range(tenants)]
    with tempfile.TemporaryDirectory(prefix="carryover-tenants-") as folder:
        key_file = Path(folder) / "keys.json"
        key_file.write_text(json.dumps({k: f"tenant-{i}" for i, k in enumerate(keys)}))
        with topology() as topo:
            p = topo.sim("prefill", "kv_producer", speed=speed)
            d = topo.sim("decode", "kv_consumer", speed=speed)
            env_flags = ["--config", str(_config(Path(folder), key_file))]
            router = topo.router("router", [p], [d], *env_flags, *flags)
            topo.wait()
            before = engine_prompt_sources(p.url)
            system = _WORD * system_tokens
            ttfts = asyncio.run(_turns(router.url, keys, per_tenant, system, "sim-qwen3"))
            after = engine_prompt_sources(p.url)
    delta = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    ordered = sorted(ttfts)
    return {
        "turns": len(ttfts),
        "ttft_p50_ms": round(1000 * statistics.median(ordered), 1),
        "ttft_p90_ms": round(1000 * ordered[int(0.9 * (len(ordered) - 1))], 1),
        "p_computed": int(delta.get("local_compute", 0)),
        "p_cache_hits": int(delta.get("local_cache_hit", 0)),
    }


def _config(folder: Path, key_file: Path) -> Path:
    path = folder / "carryover.toml"
    path.write_text(f'[router]\napi_keys_file = "{key_file}"\n')
    return path


def run_tenant_salt(
    out: Path,
    *,
    tenants: int = 8,
    per_tenant: int = 4,
    system_tokens: int = 2000,
    speed: float = 1.0,
) -> dict[str, Any]:
    results = {
        arm: _arm(
            flags,
            tenants=tenants,
            per_tenant=per_tenant,
            system_tokens=system_tokens,
            speed=speed,
        )
        for arm, flags in ARMS.items()
    }
    shared, salted = results["shared"], results["salted"]
    report = {
        "tenants": tenants,
        "per_tenant": per_tenant,
        "system_tokens": system_tokens,
        "arms": results,
        "ttft_p50_ratio_salted_to_shared": round(salted["ttft_p50_ms"] / shared["ttft_p50_ms"], 3),
        "p_computed_ratio_salted_to_shared": round(
            salted["p_computed"] / max(1, shared["p_computed"]), 3
        ),
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / "tenant_salt.json").write_text(json.dumps(report, indent=2))
    lines = [
        "| arm | first turns | TTFT p50 | TTFT p90 | P computed | P cache hits |",
        "|---|---|---|---|---|---|",
        *(
            f"| {arm} | {r['turns']} | {r['ttft_p50_ms']} ms | {r['ttft_p90_ms']} ms | "
            f"{r['p_computed']:,} | {r['p_cache_hits']:,} |"
            for arm, r in results.items()
        ),
    ]
    print("\n".join(lines))
    print(
        f"salted/shared: TTFT p50 {report['ttft_p50_ratio_salted_to_shared']}, "
        f"P computed {report['p_computed_ratio_salted_to_shared']}"
    )
    return report
