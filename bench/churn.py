"""The churn soak (``carryover bench soak --churn``): one router under an hour of what a
fleet behind DNS sees, compressed into minutes, and whether anything it keeps or spends grows.

What runs: one simulated P; one simulated D bound to every loopback address, reached through
a ``dns://`` entry whose addresses the soak rewrites every ``churn_every`` seconds (one
address leaves, a new one joins; every fourth change an address that left comes back, so a
name returns); Redis; one router (bench/churn_router.py). Load: ``conversations`` clients,
each turn after a think time, a share of them never coming back; a flood of DELETEs for ids
that were never stored; every ``large_period`` seconds a turn carrying a 1-10 MB tool list.

Time is compressed ``compression`` times: the D's ``decoder_kv_blocks_ttl``, the
request timeout (how long a DELETE's fence lasts) and the renderer's span cache (which fills
with the conversations' text) are vLLM's and the router's defaults divided by it. The first tenth starts after a warm-up (``ChurnPlan.warmup``) in which every population
has reached its steady size; the report compares the last tenth with it.
A line has grown when the last tenth exceeds the first by more than ``limit`` and by more
than the line's noise floor (what two tenths of a steady run differ by on this machine).
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import re
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any

import httpx
import redis

from carryover.bench.local_redis import local_redis
from carryover.bench.ports import free_port
from carryover.bench.procs import Process, topology
from carryover.bench.proctree import cpu_seconds, rss_mb
from carryover.router.render.spans import SPAN_CHARS

__all__ = ["ChurnPlan", "Line", "Tenth", "render_churn", "run_churn"]

_REUSED = frozenset({"reuse", "partial", "decode-local"})
_DNS_NAME = "decode"
_BUCKET = re.compile(r'^carryover_event_loop_lag_seconds_bucket\{.*le="([^"]+)".*\} (\S+)$', re.M)


@dataclass(frozen=True)
class ChurnPlan:
    seconds: float = 300.0  # measured, after the warm-up: an hour at 12x
    compression: float = 12.0
    conversations: int = 32
    think: tuple[float, float] = (0.2, 1.2)
    abandon_share: float = 0.3  # conversations that stop after a turn and never return
    churn_every: float = 3.0
    decode_addresses: int = 3
    deletes_per_second: float = 100.0
    #: About how many seconds between turns carrying a large tool list (~1% of turns); the
    #: run's own spacing is ``large_period``.
    large_every: float = 2.0
    large_mb: tuple[float, float] = (1.0, 10.0)
    seed: int = 0
    limit: float = 0.10

    @classmethod
    def short(cls) -> ChurnPlan:
        """The CI version: under a minute, 25% allowed."""
        # One size: a cycle of sizes cannot fit between the two 3 s tenths, and a tenth that
        # drew the 4 MB list against one that drew the 1 MB list read as a grown loop lag.
        return cls(seconds=30.0, compression=80.0, large_mb=(2.5, 2.5), limit=0.25)

    @property
    def ttl(self) -> float:
        return 480.0 / self.compression  # vLLM's decoder_kv_blocks_ttl default

    @property
    def request_timeout(self) -> float:
        return 900.0 / self.compression  # the router's default: a DELETE fence's lifetime

    @property
    def span_cache_chars(self) -> int:
        """The renderer's span cache, compressed too: it fills in the warm-up, not the run."""
        return int(SPAN_CHARS / self.compression)

    @property
    def warmup(self) -> float:
        """One fence lifetime and one TTL (fences, records and handles at their steady
        count), and one cycle of the large sizes (the heap at the largest's high-water)."""
        return max(self.request_timeout + self.ttl, len(self.large_sizes) * self.large_period + 2)

    @property
    def large_sizes(self) -> list[float]:
        """The tool lists' sizes (MB), in the order they cycle through."""
        low, high = self.large_mb
        return [low + (high - low) * k / 9 for k in range(10)] if high > low else [low]

    @property
    def large_period(self) -> float:
        """``large_every``, made to divide the time from the first tenth's start to the last's
        into whole cycles of ``large_sizes``: the two tenths then see the same sizes at the same
        moments (the lag line compares their p99, which one large list can move)."""
        gap = 0.9 * self.seconds
        cycle = len(self.large_sizes)
        requests = cycle * max(1, round(gap / (self.large_every * cycle)))
        return gap / requests


class Line(StrEnum):
    #: The tenth's lowest: a large request in flight lifts RSS for a while (and two at once
    #: more), so a leak shows as the floor rising, not as a peak.
    ROUTER_RSS_MB = "router RSS, lowest in the tenth (MB)"
    REDIS_MEMORY_MB = "Redis used memory (MB)"
    REDIS_KEYS = "Redis keys"
    REDIS_CPU_MS_PER_TURN = "Redis CPU per turn (ms; its claim and commit)"
    ROUTER_CPU_MS_PER_TURN = "router CPU per turn (ms)"
    LOOP_LAG_P99_MS = "event-loop lag p99 (ms)"
    REUSE_RATE = "reuse rate (later turns)"


#: What two tenths of a steady run differ by on this machine (2 shared cores): a line grows
#: only past its limit and its floor.
_FLOOR = {
    Line.ROUTER_RSS_MB: 6.0,
    Line.REDIS_MEMORY_MB: 0.5,
    Line.REDIS_KEYS: 100.0,
    Line.REDIS_CPU_MS_PER_TURN: 0.05,
    Line.ROUTER_CPU_MS_PER_TURN: 1.0,
    Line.LOOP_LAG_P99_MS: 5.0,
    Line.REUSE_RATE: 0.05,
}
_HIGHER_IS_BETTER = frozenset({Line.REUSE_RATE})


@dataclass
class _Counts:
    turns: int = 0
    later: int = 0
    reused: int = 0
    large: int = 0
    large_refused: int = 0
    errors: dict[str, int] = field(default_factory=dict)
    deletes: int = 0

    def error(self, what: str) -> None:
        self.errors[what] = self.errors.get(what, 0) + 1


@dataclass(frozen=True)
class _Snapshot:
    at: float
    router_cpu: float
    redis_cpu: float
    turns: int
    later: int
    reused: int
    lag_buckets: dict[float, float]


@dataclass(frozen=True)
class Tenth:
    """One tenth of the measured run."""

    values: dict[Line, float]
    turns: int


def _grown(line: Line, first: float, last: float, limit: float) -> bool:
    if line in _HIGHER_IS_BETTER:
        return last < first * (1 - limit) - _FLOOR[line]
    return last > first * (1 + limit) + _FLOOR[line]


def _quantile(buckets: dict[float, float], q: float) -> float:
    """Prometheus' histogram_quantile over cumulative ``le`` buckets (linear in a bucket)."""
    bounds = sorted(buckets)
    total = buckets[bounds[-1]] if bounds else 0.0
    if total <= 0:
        return 0.0
    rank, below, lower = q * total, 0.0, 0.0
    for bound in bounds:
        count = buckets[bound]
        if count >= rank:
            if bound == float("inf"):
                return lower
            inside = count - below
            return lower + (bound - lower) * ((rank - below) / inside if inside else 0.0)
        below, lower = count, bound
    return lower


def _lag_buckets(metrics: str) -> dict[float, float]:
    buckets: dict[float, float] = {}
    for le, value in _BUCKET.findall(metrics):
        bound = float(le)
        buckets[bound] = buckets.get(bound, 0.0) + float(value)
    return buckets


def _redis_cpu(client: redis.Redis) -> float:
    info: dict[str, Any] = client.info("cpu")
    return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])


def _tools(megabytes: float, rng: random.Random) -> list[dict[str, Any]]:
    """A tool list of about ``megabytes``, within the router's 1,024 tools."""
    count = 512
    each = int(megabytes * 1_000_000 / count)
    words = ["ledger", "garden", "river", "stone", "quartz", "meadow", "lantern", "harbor"]
    description = " ".join(rng.choice(words) for _ in range(each // 7))
    return [
        {
            "type": "function",
            "function": {
                "name": f"tool_{n}",
                "description": description,
                "parameters": {"type": "object", "properties": {"q": {"type": "string"}}},
            },
        }
        for n in range(count)
    ]


class _Load:
    def __init__(self, plan: ChurnPlan, url: str, stop: float) -> None:
        self.plan, self.url, self.stop = plan, url, stop
        self.counts = _Counts()

    def _live(self) -> bool:
        return time.monotonic() < self.stop

    async def conversation(self, rng: random.Random) -> None:
        async with httpx.AsyncClient(base_url=self.url, timeout=120) as client:
            while self._live():
                cid = uuid.uuid4().hex
                messages: list[dict[str, Any]] = []
                turns = rng.randint(2, 8)
                abandons_after = (
                    rng.randint(1, turns) if rng.random() < self.plan.abandon_share else 0
                )
                for turn in range(turns):
                    if not self._live():
                        return
                    text = f"[{cid} {turn}] " + "garden river stone " * rng.randint(10, 60)
                    messages.append({"role": "user", "content": text})
                    answer = await self._turn(client, cid, messages, turn)
                    if answer is None:
                        break
                    messages.append({"role": "assistant", "content": answer})
                    if turn + 1 == abandons_after:
                        break  # never comes back: its record and handle expire
                    await asyncio.sleep(rng.uniform(*self.plan.think))
                else:
                    try:
                        await client.delete(f"/v1/conversations/{cid}")
                    except httpx.HTTPError as exc:
                        self.counts.error(f"DELETE {type(exc).__name__}")

    async def _turn(
        self, client: httpx.AsyncClient, cid: str, messages: list[dict[str, Any]], turn: int
    ) -> str | None:
        body = {
            "model": "sim-qwen3",
            "messages": messages,
            "max_tokens": 12,
            "ignore_eos": True,
            "conversation_id": cid,
        }
        try:
            r = await client.post("/v1/chat/completions", json=body)
        except httpx.HTTPError as exc:
            self.counts.error(type(exc).__name__)
            return None
        if r.status_code != 200:
            self.counts.error(f"{r.status_code} {r.text[:60]}")
            return None
        self.counts.turns += 1
        if turn > 0:
            self.counts.later += 1
            self.counts.reused += r.headers.get("x-carryover-path") in _REUSED
        content: str = r.json()["choices"][0]["message"]["content"]
        return content

    async def large(self, rng: random.Random, measured_from: float) -> None:
        """A turn carrying a 1-10 MB tool list every ``large_period`` seconds, on a schedule
        fixed to the measured span's start (not after each answer, which drifts), the size
        the request's slot names: the first and the last tenth see the same mix."""
        sizes, period = self.plan.large_sizes, self.plan.large_period
        async with httpx.AsyncClient(base_url=self.url, timeout=120) as client:
            slot = math.ceil((time.monotonic() - measured_from) / period)
            while self._live():
                due = measured_from + slot * period
                await asyncio.sleep(max(due - time.monotonic(), 0.0))
                if not self._live():
                    break
                body = {
                    "model": "sim-qwen3",
                    "messages": [{"role": "user", "content": "which tool?"}],
                    "tools": _tools(sizes[slot % len(sizes)], rng),
                    "max_tokens": 4,
                    "conversation_id": f"large-{slot}",
                }
                # The next slot still ahead: one answer slower than a period skips slots.
                slot = max(slot + 1, math.ceil((time.monotonic() - measured_from) / period))
                try:
                    r = await client.post("/v1/chat/completions", json=body)
                except httpx.HTTPError as exc:
                    self.counts.error(f"large {type(exc).__name__}")
                    continue
                self.counts.large += 1
                # Beyond the model's context: refused with a 400 by the router, P never sees it.
                self.counts.large_refused += r.status_code == 400

    async def deletes(self) -> None:
        """DELETEs of ids never stored, each leaving a fence for the request timeout."""
        batch = 10
        async with httpx.AsyncClient(base_url=self.url, timeout=30) as client:
            while self._live():
                started = time.monotonic()
                ids = [uuid.uuid4().hex for _ in range(batch)]
                answers = await asyncio.gather(
                    *(client.delete(f"/v1/conversations/{i}") for i in ids),
                    return_exceptions=True,
                )
                for answer in answers:
                    if isinstance(answer, BaseException):
                        self.counts.error(f"flood {type(answer).__name__}")
                    else:
                        self.counts.deletes += 1
                pause = batch / self.plan.deletes_per_second - (time.monotonic() - started)
                await asyncio.sleep(max(pause, 0.0))


class _Membership:
    """The decode set as DNS would list it: one address leaves and one joins per change."""

    def __init__(self, path: Path, size: int) -> None:
        self.path = path
        self.next = 2
        self.live = [self._new() for _ in range(size)]
        self.left: list[str] = []
        self.changes = 0
        self._write()

    def _new(self) -> str:
        address = f"127.0.{self.next // 250}.{self.next % 250 + 2}"
        self.next += 1
        return address

    def _write(self) -> None:
        staged = self.path.with_suffix(".new")
        staged.write_text(json.dumps({_DNS_NAME: self.live}))
        staged.replace(self.path)  # the resolver reads whole files only

    def change(self) -> None:
        self.changes += 1
        self.left.append(self.live.pop(0))
        returning = self.changes % 4 == 0 and len(self.left) > 1
        self.live.append(self.left.pop(0) if returning else self._new())
        self._write()


async def _churn(membership: _Membership, plan: ChurnPlan, stop: float) -> None:
    while time.monotonic() < stop:
        await asyncio.sleep(plan.churn_every)
        membership.change()


def _measure(
    router: Process, store: redis.Redis, load: _Load, started: float
) -> Callable[[], _Snapshot]:
    def snapshot() -> _Snapshot:
        metrics = httpx.get(router.url + "/metrics", timeout=10).text
        counts = load.counts
        return _Snapshot(
            at=time.monotonic() - started,
            router_cpu=cpu_seconds(router.popen.pid),
            redis_cpu=_redis_cpu(store),
            turns=counts.turns,
            later=counts.later,
            reused=counts.reused,
            lag_buckets=_lag_buckets(metrics),
        )

    return snapshot


def _tenth(
    begin: _Snapshot, end: _Snapshot, levels: list[tuple[float, float, float, float]]
) -> Tenth:
    """``levels``: (at, RSS MB, Redis MB, Redis keys) sampled within the tenth each second;
    Redis's levels are their median, RSS its lowest (``Line.ROUTER_RSS_MB``)."""

    def median(index: int) -> float:
        values = sorted(level[index] for level in levels)
        return values[len(values) // 2] if values else 0.0

    turns = max(end.turns - begin.turns, 1)
    later = max(end.later - begin.later, 1)
    lag = {b: end.lag_buckets.get(b, 0.0) - begin.lag_buckets.get(b, 0.0) for b in end.lag_buckets}
    return Tenth(
        {
            Line.ROUTER_RSS_MB: min((level[1] for level in levels), default=0.0),
            Line.REDIS_MEMORY_MB: median(2),
            Line.REDIS_KEYS: median(3),
            Line.REDIS_CPU_MS_PER_TURN: (end.redis_cpu - begin.redis_cpu) * 1000 / turns,
            Line.ROUTER_CPU_MS_PER_TURN: (end.router_cpu - begin.router_cpu) * 1000 / turns,
            Line.LOOP_LAG_P99_MS: _quantile(lag, 0.99) * 1000,
            Line.REUSE_RATE: (end.reused - begin.reused) / later,
        },
        end.turns - begin.turns,
    )


def run_churn(plan: ChurnPlan, *, log_dir: Path | None = None) -> dict[str, Any]:
    """Run the soak; the first and last tenth, each line's growth and whether it grew."""
    with local_redis() as redis_url, topology(log_dir=log_dir) as topo:
        addresses = topo.log_dir / "decode-addresses.json"
        membership = _Membership(addresses, plan.decode_addresses)
        lifetimes = {"decoder_kv_blocks_ttl": plan.ttl}
        prefill = topo.sim("prefill", "kv_producer", speed=0.05, extra_config=lifetimes)
        port = free_port()
        topo.sim(  # on every loopback address: each address DNS lists is "an instance"
            "decode",
            "kv_consumer",
            speed=0.05,
            extra_config=lifetimes,
            extra=("--host", "0.0.0.0"),
            port=port,
        )
        flags = (
            *("--redis", redis_url, "--decoder-kv-blocks-ttl", f"{plan.ttl}"),
            *("--request-timeout", f"{plan.request_timeout}", "--health-interval", "1"),
            *("--held-interval", "2", "--queue-margin", "1", "--expiry-safety-margin", "1"),
            *("--span-cache-chars", str(plan.span_cache_chars)),
        )
        router = topo.router(
            "router",
            [prefill],
            [],
            "--decode",
            f"dns://{_DNS_NAME}:{port}",
            *flags,
            entry=("-m", "carryover.bench.churn_router", str(addresses)),
        )
        topo.wait()
        store = redis.Redis.from_url(redis_url)
        return asyncio.run(_soak(plan, router, store, membership))


async def _soak(
    plan: ChurnPlan, router: Process, store: redis.Redis, membership: _Membership
) -> dict[str, Any]:
    started = time.monotonic()
    measured_from = started + plan.warmup
    stop = measured_from + plan.seconds
    load = _Load(plan, router.url, stop)
    rng = random.Random(plan.seed)
    snapshot = _measure(router, store, load, started)
    tenth = plan.seconds / 10
    marks = [measured_from, measured_from + tenth, stop - tenth, stop]
    snapshots: list[_Snapshot] = []
    levels: list[tuple[float, float, float, float]] = []

    async def sample() -> None:
        for mark in marks:
            while (now := time.monotonic()) < mark:
                if now >= measured_from:
                    memory = await asyncio.to_thread(store.info, "memory")
                    keys = await asyncio.to_thread(store.dbsize)
                    levels.append(
                        (
                            now - started,
                            rss_mb(router.popen.pid),
                            float(memory["used_memory"]) / 1e6,
                            float(keys),
                        )
                    )
                await asyncio.sleep(min(1.0, max(mark - now, 0.0)))
            snapshots.append(await asyncio.to_thread(snapshot))

    await asyncio.gather(
        *(load.conversation(random.Random(rng.random())) for _ in range(plan.conversations)),
        load.large(random.Random(rng.random()), measured_from),
        load.deletes(),
        _churn(membership, plan, stop),
        sample(),
    )
    first_at = (snapshots[0].at, snapshots[1].at)
    last_at = (snapshots[2].at, snapshots[3].at)
    first = _tenth(
        snapshots[0], snapshots[1], [x for x in levels if first_at[0] <= x[0] <= first_at[1]]
    )
    last = _tenth(
        snapshots[2], snapshots[3], [x for x in levels if last_at[0] <= x[0] <= last_at[1]]
    )
    lines = {
        line.value: {
            "first": first.values[line],
            "last": last.values[line],
            "growth": last.values[line] / first.values[line] - 1 if first.values[line] else 0.0,
            "floor": _FLOOR[line],
            "grown": _grown(line, first.values[line], last.values[line], plan.limit),
        }
        for line in Line
    }
    counts = load.counts
    return {
        "plan": {
            **vars(plan),
            "ttl": plan.ttl,
            "request_timeout": plan.request_timeout,
            "span_cache_chars": plan.span_cache_chars,
            "warmup": plan.warmup,
        },
        "lines": lines,
        "grown": [name for name, line in lines.items() if line["grown"]],
        "turns": counts.turns,
        "turns_first_last_tenth": [first.turns, last.turns],
        "large_turns": counts.large,
        "large_refused_400": counts.large_refused,
        "large_share": counts.large / max(counts.turns + counts.large, 1),
        "deletes_of_unknown_ids": counts.deletes,
        "membership_changes": membership.changes,
        "addresses_used": membership.next - 2,
        "errors": counts.errors,
        "router_rss_mb_peak": max((level[1] for level in levels), default=0.0),
        "levels": [
            {"t": at, "router_rss_mb": rss, "redis_mb": mb, "redis_keys": keys}
            for at, rss, mb, keys in levels
        ],
    }


def render_churn(report: dict[str, Any]) -> str:
    plan = report["plan"]
    rows = [
        "| line | first tenth | last tenth | growth | noise floor | grown |",
        "|---|---|---|---|---|---|",
    ]
    for name, line in report["lines"].items():
        rows.append(
            f"| {name} | {line['first']:.3f} | {line['last']:.3f} | {line['growth']:+.1%} "
            f"| {line['floor']} | {'**yes**' if line['grown'] else 'no'} |"
        )
    return "\n".join(
        [
            f"Churn soak: {plan['seconds']:.0f} s measured after {plan['warmup']:.0f} s "
            f"of warm-up, time compressed {plan['compression']:.0f}x (D TTL {plan['ttl']:.0f} s, "
            f"request timeout {plan['request_timeout']:.1f} s, span cache "
            f"{plan.get('span_cache_chars', SPAN_CHARS):,} characters), limit {plan['limit']:.0%}",
            "",
            *rows,
            "",
            f"turns {report['turns']} (first/last tenth {report['turns_first_last_tenth']}), "
            f"large-tool turns {report['large_turns']} ({report['large_share']:.1%}, "
            f"{report['large_refused_400']} refused 400), DELETEs of unknown ids "
            f"{report['deletes_of_unknown_ids']}, membership changes "
            f"{report['membership_changes']} over {report['addresses_used']} addresses, "
            f"router RSS peak {report['router_rss_mb_peak']:.0f} MB, "
            f"errors {report['errors'] or 'none'}",
        ]
    )
