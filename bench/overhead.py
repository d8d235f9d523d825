"""Router overhead: the same requests direct to a zero-delay simulated engine and through a
router in front of a zero-delay P/D pair, as vLLM's router documents its overhead numbers.

Arms: carryover with in-process state, with Redis state (one worker, and more with
``workers``), and any peer router given as ``NAME=URL`` (already running in front of the
engines' fixed ports) or ``NAME=COMMAND`` (started here; ``{port}``, ``{prefill}`` and
``{decode}`` are filled in). Modes: ``completions`` (a 128-id prompt, 4 tokens), ``stream``
(the same streamed: time to the first event counts too) and ``chat`` (a ~200-token chat,
four turns of one conversation, rendered by the router). carryover's requests carry a
``conversation_id``, so every turn claims and commits; a peer gets the same requests
without it.

Reported per row: mean - direct (and first event - direct's first event when streamed),
p50/p99, turns/s, CPU seconds of the router's process tree per 1,000 turns; per arm, the
tree's RSS at rest (after startup), after the load and at its peak. The engines and the load
generator run on the same machine as the router: every figure is a ratio against the direct
baseline or a peer measured in the same run, not an absolute. On a loud machine, ``rounds``
measures every arm several times, the arms taking turns, and reports each figure's median.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import shlex
import signal
import statistics
import subprocess
import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx

from carryover.bench.loadgen import Job, Sample, closed_loop
from carryover.bench.local_redis import local_redis
from carryover.bench.ports import free_port
from carryover.bench.procs import Process, Topology, topology
from carryover.bench.proctree import cpu_seconds, listening_pid, rss_mb
from carryover.bench.report import percentile

__all__ = [
    "LONG",
    "MODES",
    "Peer",
    "decode_sim_options",
    "jobs_for",
    "parse_peer",
    "render_overhead",
    "run_overhead",
]

MODES = ("completions", "stream", "chat")
#: Not in the default modes: an agent-like conversation whose prompt grows past 20k tokens,
#: where the router's per-token work (hashing, checking, the legs' bodies) shows.
LONG = "long"
_CHAT_TURNS = 4
_LONG_TURNS = 28
_LONG_WORDS = 800  # about 800 tokens a tool result: turn 28's prompt is past 20k
_VOCABULARY = (
    "the of and to in is that for it as with was on be by at this from or an are not have "
    "but were which one all their there been has more when will would who so if out into "
    "than them only other some time could these two may then first any like now over such "
    "our what just also after new used between through where much before those while"
)
_WORDS = _VOCABULARY.split()
_DECODE_BLOCKS = 262_144
_DECODE_TTL = 3.0  # seconds; a conversation's four chat turns take milliseconds
_SYSTEM = " ".join(f"Rule {n}: answer in plain words and keep it short." for n in range(14))


@dataclass(frozen=True)
class Peer:
    """Another router measured in the same run."""

    name: str
    url: str | None = None  #: already running
    command: str | None = None  #: started here


def parse_peer(text: str) -> Peer:
    name, sep, target = text.partition("=")
    if not sep or not name or not target:
        raise ValueError(f"--peer takes NAME=URL or NAME=COMMAND, not {text!r}")
    if target.startswith(("http://", "https://")):
        return Peer(name, url=target.rstrip("/"))
    return Peer(name, command=target)


def jobs_for(mode: str, count: int, *, conversation: bool) -> list[Job]:
    """``count`` turns of ``mode``."""
    jobs = []
    if mode == LONG:
        return _long_jobs(count, conversation=conversation)
    if mode == "chat":
        for n in range(max(1, count // _CHAT_TURNS)):
            body: dict[str, Any] = {
                "model": "sim-qwen3",
                "messages": [
                    {"role": "system", "content": _SYSTEM},
                    {"role": "user", "content": f"Question {n}: what should I read next?"},
                ],
                "max_tokens": 8,
            }
            if conversation:
                body["conversation_id"] = uuid.uuid4().hex
            follow_ups = tuple(f"And after that, {t}?" for t in range(_CHAT_TURNS - 1))
            jobs.append(Job("/v1/chat/completions", body, follow_ups))
        return jobs
    for _ in range(count):
        body = {"model": "sim-qwen3", "prompt": list(range(1000, 1128)), "max_tokens": 4}
        body["ignore_eos"] = True
        if mode == "stream":
            body["stream"] = True
        if conversation:
            body["conversation_id"] = uuid.uuid4().hex
        jobs.append(Job("/v1/completions", body))
    return jobs


def _long_jobs(count: int, *, conversation: bool) -> list[Job]:
    """Conversations of ``_LONG_TURNS`` turns, each follow-up a tool-sized block of text."""
    jobs = []
    for n in range(max(1, count // _LONG_TURNS)):
        rng = random.Random(n)
        texts = tuple(
            " ".join(rng.choice(_WORDS) for _ in range(_LONG_WORDS)) for _ in range(_LONG_TURNS)
        )
        body: dict[str, Any] = {
            "model": "sim-qwen3",
            "messages": [
                {"role": "system", "content": _SYSTEM * 8},
                {"role": "user", "content": texts[0]},
            ],
            "max_tokens": 8,
        }
        if conversation:
            body["conversation_id"] = uuid.uuid4().hex
        jobs.append(Job("/v1/chat/completions", body, texts[1:]))
    return jobs


def decode_sim_options() -> dict[str, Any]:
    """The simulated D's options. Every turn leaves its KV pinned on D for the TTL
    (bidirectional transfer), and most turns here are conversations of one turn: a short TTL
    and a large pool keep the tens of thousands of pins of a run from filling D."""
    return {
        "extra": ["--sim-num-blocks", str(_DECODE_BLOCKS)],
        "extra_config": {"decoder_kv_blocks_ttl": _DECODE_TTL},
    }


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values)


@dataclass
class _Target:
    """A router under test: where it answers and whose CPU counts."""

    name: str
    url: str
    pid: int | None
    conversation: bool


def _wait_healthy(url: str, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return
        time.sleep(0.1)
    raise RuntimeError(f"{url} did not become healthy")


@contextlib.contextmanager
def _peer(peer: Peer, prefill: Process, decode: Process, log_dir: Path) -> Iterator[_Target]:
    if peer.url is not None:
        _wait_healthy(peer.url)
        port = urlsplit(peer.url).port or 80
        yield _Target(peer.name, peer.url, listening_pid(port), conversation=False)
        return
    assert peer.command is not None
    port = free_port()
    argv = shlex.split(peer.command.format(port=port, prefill=prefill.url, decode=decode.url))
    with open(log_dir / f"peer-{peer.name}.log", "ab") as log:
        popen = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        _wait_healthy(f"http://127.0.0.1:{port}")
        yield _Target(peer.name, f"http://127.0.0.1:{port}", popen.pid, conversation=False)
    finally:
        with contextlib.suppress(ProcessLookupError):
            popen.send_signal(signal.SIGTERM)
        try:
            popen.wait(timeout=10)
        except subprocess.TimeoutExpired:
            popen.kill()
            popen.wait()


@contextlib.contextmanager
def _carryover(
    topo: Topology, name: str, prefill: Process, decode: Process, flags: Sequence[str]
) -> Iterator[_Target]:
    router = topo.router(name, [prefill], [decode], *flags)
    topo.wait()
    try:
        yield _Target(name, router.url, router.popen.pid, conversation=True)
    finally:
        router.stop()
        topo.processes.remove(router)


def _row(
    target: _Target, mode: str, concurrency: int, direct: list[Sample], routed: list[Sample]
) -> dict[str, Any]:
    latencies = [s.latency for s in routed]
    return {
        "arm": target.name,
        "mode": mode,
        "concurrency": concurrency,
        "turns": len(routed),
        "direct_mean_us": _mean([s.latency for s in direct]) * 1e6,
        "router_mean_us": _mean(latencies) * 1e6,
        "mean_minus_direct_us": (_mean(latencies) - _mean([s.latency for s in direct])) * 1e6,
        "first_minus_direct_us": (
            _mean([s.first_chunk for s in routed]) - _mean([s.first_chunk for s in direct])
        )
        * 1e6,
        "router_p50_us": percentile(latencies, 50) * 1e6,
        "router_p99_us": percentile(latencies, 99) * 1e6,
        "direct_p50_us": percentile([s.latency for s in direct], 50) * 1e6,
    }


def _measure(
    target: _Target,
    direct: Process,
    modes: Sequence[str],
    plan: Sequence[tuple[int, int]],
) -> list[dict[str, Any]]:
    rows = []
    for mode in modes:
        for concurrency, count in plan:
            warm = jobs_for(mode, 4 * concurrency, conversation=target.conversation)
            asyncio.run(closed_loop(target.url, warm, concurrency))
            base, _ = asyncio.run(
                closed_loop(direct.url, jobs_for(mode, count, conversation=False), concurrency)
            )
            jobs = jobs_for(mode, count, conversation=target.conversation)
            cpu = cpu_seconds(target.pid) if target.pid else None
            routed, wall = asyncio.run(closed_loop(target.url, jobs, concurrency))
            row = _row(target, mode, concurrency, base, routed)
            row["turns_per_s"] = len(routed) / wall
            if cpu is not None and target.pid:
                row["cpu_s_per_1000_turns"] = (cpu_seconds(target.pid) - cpu) / len(routed) * 1000
            rows.append(row)
    return rows


def _memory(target: _Target, at_rest: float | None) -> dict[str, Any]:
    if not target.pid:
        return {"arm": target.name}
    return {
        "arm": target.name,
        "rss_rest_mb": at_rest,
        "rss_after_mb": rss_mb(target.pid),
        "rss_peak_mb": rss_mb(target.pid, peak=True),
    }


def run_overhead(
    out: Path,
    *,
    requests: Sequence[int] = (1000, 6000),
    concurrency: Sequence[int] = (1, 64),
    modes: Sequence[str] = MODES,
    peers: Sequence[Peer] = (),
    redis: bool = True,
    workers: Sequence[int] = (1,),
    prefill_port: int | None = None,
    decode_port: int | None = None,
    rounds: int = 1,
) -> dict[str, Any]:
    """Every arm measured ``rounds`` times, the arms taking turns within each round (a loud
    machine then slows all of them, not one); ``rows`` and ``memory`` hold each figure's
    median over the rounds, ``round_rows`` every round's own."""
    if rounds < 1:
        raise ValueError("rounds must be at least 1")
    plan = list(zip(concurrency, requests, strict=True))
    rows: list[dict[str, Any]] = []
    memory: list[dict[str, Any]] = []
    stack = contextlib.ExitStack()
    with stack, topology() as topo:
        direct = topo.sim("direct", None, speed=0)
        p = topo.sim("prefill", "kv_producer", speed=0, port=prefill_port)
        d = topo.sim("decode", "kv_consumer", speed=0, port=decode_port, **decode_sim_options())
        topo.wait()
        arms: list[tuple[str, list[str]]] = [("carryover", [])]
        if redis:
            url = stack.enter_context(local_redis())
            arms += [
                (
                    f"carryover-redis{'' if n == 1 else f'-w{n}'}",
                    ["--redis", url, "--workers", str(n)],
                )
                for n in workers
            ]
        for number in range(rounds):
            for name, flags in arms:
                with _carryover(topo, name, p, d, flags) as target:
                    _measure_arm(target, direct, modes, plan, number, rows, memory)
            for peer in peers:
                with _peer(peer, p, d, topo.log_dir) as target:
                    _measure_arm(target, direct, modes, plan, number, rows, memory)
    results = {
        "rows": _medians(rows, ("arm", "mode", "concurrency")),
        "memory": _medians(memory, ("arm",)),
        "peers": [peer.name for peer in peers],
        "rounds": rounds,
        "round_rows": rows,
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / "overhead.json").write_text(json.dumps(results, indent=2))
    report = render_overhead(results)
    (out / "overhead.md").write_text(report)
    print(report)
    return results


def _measure_arm(
    target: _Target,
    direct: Process,
    modes: Sequence[str],
    plan: Sequence[tuple[int, int]],
    number: int,
    rows: list[dict[str, Any]],
    memory: list[dict[str, Any]],
) -> None:
    at_rest = rss_mb(target.pid) if target.pid else None
    rows += [{**row, "round": number} for row in _measure(target, direct, modes, plan)]
    memory.append({**_memory(target, at_rest), "round": number})


def _medians(rows: Sequence[dict[str, Any]], key: tuple[str, ...]) -> list[dict[str, Any]]:
    """One row per ``key``, in first-seen order: each number the median of its rounds'."""
    groups: dict[tuple[Any, ...], list[dict[str, Any]]] = {}
    for row in rows:
        groups.setdefault(tuple(row[k] for k in key), []).append(row)
    merged = []
    for group in groups.values():
        row = {k: v for k, v in group[0].items() if k != "round"}
        for name, value in row.items():
            if name in key or not isinstance(value, int | float):
                continue
            values = [r[name] for r in group if r.get(name) is not None]
            row[name] = statistics.median(values) if values else None
        row["rounds"] = len(group)
        merged.append(row)
    return merged


def render_overhead(results: dict[str, Any]) -> str:
    lines = [
        "# Router overhead (zero-delay simulated engines; engines, client and router share "
        "the machine's cores)",
        *(
            [f"Each figure is the median of {results['rounds']} rounds (the arms take turns)."]
            if results.get("rounds", 1) > 1
            else []
        ),
        "",
        "| mode | arm | conc. | mean - direct | first event - direct | p50 / p99 | direct p50 "
        "| turns/s | CPU s / 1k turns |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results["rows"]:
        first = f"{r['first_minus_direct_us'] / 1000:.2f} ms" if r["mode"] == "stream" else "—"
        cpu = r.get("cpu_s_per_1000_turns")
        lines.append(
            f"| {r['mode']} | {r['arm']} | {r['concurrency']} "
            f"| {r['mean_minus_direct_us'] / 1000:.2f} ms | {first} "
            f"| {r['router_p50_us'] / 1000:.2f} / {r['router_p99_us'] / 1000:.2f} ms "
            f"| {r['direct_p50_us'] / 1000:.2f} ms | {r['turns_per_s']:.0f} "
            f"| {'—' if cpu is None else f'{cpu:.2f}'} |"
        )
    lines += ["", "| arm | RSS at rest | RSS after the load | peak RSS |", "|---|---|---|---|"]
    for m in results["memory"]:
        cells = [m.get(k) for k in ("rss_rest_mb", "rss_after_mb", "rss_peak_mb")]
        lines.append(
            f"| {m['arm']} | "
            + " | ".join("—" if c is None else f"{c:.0f} MiB" for c in cells)
            + " |"
        )
    lines += ["", *_ratios(results), ""]
    return "\n".join(lines)


def _ratios(results: dict[str, Any]) -> list[str]:
    """carryover against each peer: p50 at the lowest concurrency, turns/s at the highest."""
    out = []
    rows = results["rows"]
    for peer in results["peers"]:
        for mode in dict.fromkeys(r["mode"] for r in rows):
            mine = [r for r in rows if r["arm"] == "carryover" and r["mode"] == mode]
            theirs = {r["concurrency"]: r for r in rows if r["arm"] == peer and r["mode"] == mode}
            if not mine or not theirs:
                continue
            low = min(r["concurrency"] for r in mine)
            high = max(r["concurrency"] for r in mine)
            by = {r["concurrency"]: r for r in mine}
            if low in theirs and high in theirs:
                mine_cpu = by[low].get("cpu_s_per_1000_turns")
                their_cpu = theirs[low].get("cpu_s_per_1000_turns")
                cpu = (
                    f", CPU per turn at concurrency {low} x{mine_cpu / their_cpu:.2f}"
                    if mine_cpu is not None and their_cpu
                    else ""
                )
                out.append(
                    f"- {mode}, carryover against {peer}: p50 at concurrency {low} "
                    f"x{by[low]['router_p50_us'] / theirs[low]['router_p50_us']:.2f}, "
                    f"turns/s at {high} "
                    f"x{by[high]['turns_per_s'] / theirs[high]['turns_per_s']:.2f}{cpu}"
                )
    return out
