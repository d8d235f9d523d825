"""Soak: many live conversations through two routers sharing Redis, bounded in count and time.

Reports, every few seconds, the routers' RSS, the number of records in Redis and the handles
decode instances hold; at the end, handles that expired unused. A steady system shows no
growth trend in RSS or keys once the conversation population is stable.

``python -m carryover.bench.soak --conversations 1000 --minutes 10`` (defaults are the issue's numbers).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
import uuid
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx
import redis

from carryover.bench.local_redis import local_redis
from carryover.bench.procs import topology
from carryover.bench.proctree import rss_mb
from carryover.bench.report import percentile


def _gauge(text: str, name: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name))


def _slope(points: list[tuple[float, float]]) -> float:
    """Least-squares slope (units per minute) of the second half of a series."""
    half = points[len(points) // 2 :]
    if len(half) < 2:
        return 0.0
    mx = sum(x for x, _ in half) / len(half)
    my = sum(y for _, y in half) / len(half)
    var = sum((x - mx) ** 2 for x, _ in half)
    return 60 * sum((x - mx) * (y - my) for x, y in half) / var if var else 0.0


_SLOW = 10.0  # seconds: a request this slow is listed with when and where it ran


async def _conversation(
    urls: list[str],
    stop: float,
    rng: random.Random,
    counts: Counter[str],
    latencies: list[float],
    slow: list[dict[str, Any]],
    started: float,
) -> None:
    """Conversations of 2-8 turns; half end with DELETE (a client that says goodbye), the
    others are abandoned and leave their handle to expire."""
    async with httpx.AsyncClient(timeout=60) as client:
        while time.monotonic() < stop:
            cid = uuid.uuid4().hex
            messages: list[dict[str, Any]] = []
            ends_politely = rng.random() < 0.5
            turns = rng.randint(2, 8)
            for turn in range(turns):
                if time.monotonic() >= stop:
                    return
                messages.append(
                    {
                        "role": "user",
                        "content": f"[{cid} {turn}] " + "garden river stone " * rng.randint(20, 80),
                    }
                )
                body = {
                    "model": "sim-qwen3",
                    "messages": messages,
                    "max_tokens": 24,
                    "ignore_eos": True,
                    "conversation_id": cid,
                }
                url = urls[turn % len(urls)]
                sent = time.monotonic()
                try:
                    r = await client.post(url + "/v1/chat/completions", json=body)
                except httpx.HTTPError as exc:
                    counts["errors"] += 1
                    counts[f"error: {type(exc).__name__}"] += 1
                    slow.append(_slow_entry(sent, started, url, cid, turn, type(exc).__name__))
                    break
                took = time.monotonic() - sent
                latencies.append(took)
                if took > _SLOW:
                    slow.append(_slow_entry(sent, started, url, cid, turn, str(r.status_code)))
                counts["requests"] += 1
                if r.status_code != 200:
                    counts["errors"] += 1
                    counts[f"error: {r.status_code} {r.text[:80]}"] += 1
                    break
                messages.append(
                    {"role": "assistant", "content": r.json()["choices"][0]["message"]["content"]}
                )
                await asyncio.sleep(rng.uniform(1.0, 6.0))  # think time keeps the rate bounded
            else:
                key = "ended" if ends_politely else "abandoned"
                if ends_politely:
                    try:
                        ended = await client.delete(f"{urls[0]}/v1/conversations/{cid}")
                        if ended.status_code != 200:
                            counts["errors"] += 1
                            counts[f"error: DELETE {ended.status_code}"] += 1
                    except httpx.HTTPError as exc:
                        counts["errors"] += 1
                        counts[f"error: DELETE {type(exc).__name__}"] += 1
                counts[key] += 1


def _slow_entry(
    sent: float, started: float, url: str, cid: str, turn: int, outcome: str
) -> dict[str, Any]:
    return {
        "sent_at_s": round(sent - started, 1),
        "took_s": round(time.monotonic() - sent, 1),
        "router": url,
        "conversation_id": cid,
        "turn": turn + 1,
        "outcome": outcome,
    }


async def _drive(
    urls: list[str],
    conversations: int,
    seconds: float,
    seed: int,
    counts: Counter[str],
    latencies: list[float],
    slow: list[dict[str, Any]],
) -> None:
    rng = random.Random(seed)
    started = time.monotonic()
    stop = started + seconds
    await asyncio.gather(
        *(
            _conversation(urls, stop, random.Random(rng.random()), counts, latencies, slow, started)
            for _ in range(conversations)
        )
    )


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--conversations", type=int, default=1000)
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--interval", type=float, default=5.0)
    parser.add_argument(
        "--ttl", type=float, default=60.0, help="decoder_kv_blocks_ttl of the simulated D"
    )
    parser.add_argument("--out", type=Path, default=Path("results/soak"))
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    seconds = args.minutes * 60
    samples: list[dict[str, float]] = []
    latencies: list[float] = []
    slow: list[dict[str, Any]] = []
    counts: Counter[str] = Counter({"requests": 0, "errors": 0, "ended": 0, "abandoned": 0})
    with local_redis() as redis_url, topology() as topo:
        ttl_config = {"decoder_kv_blocks_ttl": args.ttl}
        ps = [
            topo.sim(f"prefill-{i}", "kv_producer", speed=0.05, extra_config=ttl_config)
            for i in range(2)
        ]
        ds = [
            topo.sim(f"decode-{i}", "kv_consumer", speed=0.05, extra_config=ttl_config)
            for i in range(2)
        ]
        flags = (
            "--redis",
            redis_url,
            "--decoder-kv-blocks-ttl",
            str(args.ttl),
            "--queue-margin",
            "5",
            "--held-interval",
            "2",
        )
        routers = [topo.router(f"router-{i}", ps, ds, *flags) for i in range(2)]
        topo.wait()
        store = redis.Redis.from_url(redis_url)
        started = time.monotonic()

        async def sample_loop() -> None:
            # Sampling goes on for a TTL after the load stops: every pin left must expire by
            # then, and the counts of expired handles settle.
            while time.monotonic() - started < seconds + args.ttl + 2 * args.interval:
                texts = [
                    (await asyncio.to_thread(httpx.get, d.url + "/metrics", timeout=5)).text
                    for d in ds
                ]
                prefills = [
                    (await asyncio.to_thread(httpx.get, p.url + "/metrics", timeout=5)).text
                    for p in ps
                ]
                routed = [
                    (await asyncio.to_thread(httpx.get, r.url + "/metrics", timeout=5)).text
                    for r in routers
                ]
                samples.append(
                    {
                        "t": time.monotonic() - started,
                        "router_rss_mb": sum(rss_mb(r.popen.pid) for r in routers),
                        "store_keys": float(store.dbsize()),
                        "pinned_handles": sum(_gauge(t, "sim:pinned_handles") for t in texts),
                        # a full KV pool makes requests wait for blocks (pins expire at TTL)
                        "decode_kv_usage_max": max(
                            _gauge(t, "vllm:kv_cache_usage_perc") for t in texts
                        ),
                        "decode_waiting": sum(
                            _gauge(t, "vllm:num_requests_waiting") for t in texts
                        ),
                        "prefill_kv_usage_max": max(
                            _gauge(t, "vllm:kv_cache_usage_perc") for t in prefills
                        ),
                        "prefill_waiting": sum(
                            _gauge(t, "vllm:num_requests_waiting") for t in prefills
                        ),
                        "expired_unused": sum(_gauge(t, "sim:expired_pins_total") for t in texts),
                        # what the routers say of the same: stored handles that expired
                        # unclaimed (abandoned), handles they gave back, gauges per D
                        "router_expired_unused": sum(
                            _gauge(t, "carryover_decode_handles_expired_unused_total")
                            for t in routed
                        ),
                        "router_held": _gauge(routed[0], "carryover_decode_handles{"),
                        "released": sum(
                            _gauge(t, "carryover_handles_released_total") for t in routed
                        ),
                        "requests": counts["requests"],
                    }
                )
                await asyncio.sleep(args.interval)

        async def run() -> None:
            await asyncio.gather(
                _drive(
                    [r.url for r in routers],
                    args.conversations,
                    seconds,
                    args.seed,
                    counts,
                    latencies,
                    slow,
                ),
                sample_loop(),
            )

        asyncio.run(run())
    rss = [(s["t"], s["router_rss_mb"]) for s in samples]
    keys = [(s["t"], s["store_keys"]) for s in samples]
    summary = {
        "conversations": args.conversations,
        "seconds": seconds,
        "requests": counts["requests"],
        "errors": counts["errors"],
        "errors_by_kind": {k[7:]: v for k, v in counts.items() if k.startswith("error: ")},
        "latency_s": {
            "p50": percentile(latencies, 50),
            "p99": percentile(latencies, 99),
            "max": max(latencies),
        }
        if latencies
        else None,
        f"requests_over_{_SLOW:.0f}s_or_failed": slow,
        "decode_kv_usage_peak": max((s["decode_kv_usage_max"] for s in samples), default=0.0),
        "decode_waiting_peak": max((s["decode_waiting"] for s in samples), default=0.0),
        "prefill_kv_usage_peak": max((s["prefill_kv_usage_max"] for s in samples), default=0.0),
        "prefill_waiting_peak": max((s["prefill_waiting"] for s in samples), default=0.0),
        "router_rss_mb_first_last": [rss[0][1], rss[-1][1]] if rss else None,
        "router_rss_slope_mb_per_min_second_half": _slope(rss),
        "store_keys_slope_per_min_second_half": _slope(keys),
        "conversations_ended_with_delete": counts["ended"],
        "conversations_abandoned": counts["abandoned"],
        # by reason: D's own count of pins that expired unused, against what the store saw
        # expire unclaimed (abandoned conversations); the rest would be handles the router lost
        "handles_expired_unused_at_decode": samples[-1]["expired_unused"] if samples else None,
        "handles_expired_unused_abandoned": samples[-1]["router_expired_unused"]
        if samples
        else None,
        "handles_expired_unused_lost": (
            samples[-1]["expired_unused"] - samples[-1]["router_expired_unused"]
            if samples
            else None
        ),
        "handles_released_by_router": samples[-1]["released"] if samples else None,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "soak.json").write_text(
        json.dumps({"summary": summary, "samples": samples}, indent=2)
    )
    lines = [
        "# Soak",
        "",
        "| t (s) | router RSS (MB) | store keys | pinned at D | held (router) | expired unused at D "
        "| of which abandoned | D KV use (max) | D waiting | P KV use (max) | P waiting | requests |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    lines += [
        f"| {s['t']:.0f} | {s['router_rss_mb']:.0f} | {s['store_keys']:.0f} | {s['pinned_handles']:.0f} "
        f"| {s['router_held']:.0f} | {s['expired_unused']:.0f} | {s['router_expired_unused']:.0f} "
        f"| {s['decode_kv_usage_max']:.2f} | {s['decode_waiting']:.0f} "
        f"| {s['prefill_kv_usage_max']:.2f} | {s['prefill_waiting']:.0f} | {s['requests']:.0f} |"
        for s in samples
    ]
    lines += ["", "```", json.dumps(summary, indent=2), "```", ""]
    (args.out / "soak.md").write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
