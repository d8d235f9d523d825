"""Run the same multi-turn workload against several arms, each on fresh engines."""

from __future__ import annotations

import asyncio
import contextlib
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from carryover.bench.fleet_counters import (
    DecodeSampler,
    leg_means,
    pressure_releases,
    prompt_sources,
    retries,
    router_turns,
    scrape,
    wait_rendering,
)
from carryover.bench.lifetimes import Lifetimes
from carryover.bench.local_redis import local_redis
from carryover.bench.peers import POLICIES, ensure_vllm_router, vllm_router_args
from carryover.bench.placement import Placement
from carryover.bench.procs import Process, free_port, topology
from carryover.bench.proctree import CpuMeter, engines_cpu
from carryover.bench.report import Slo, build_report, lag_summary, write_report
from carryover.bench.runner import TurnRecord, run_arm
from carryover.bench.workload import Conversation

__all__ = ["ARMS", "ArmResult", "run_arms"]

#: Router flags per arm; ``None`` is the colocated baseline (one engine, both phases, no router).
ARMS: dict[str, list[str] | None] = {
    "carryover": [],
    # Pulls priced at nothing (docs/turn-costs.md): the handle goes whenever it adds a token.
    "carryover-always-pull": ["--cost-pull-tokens", "0", "--cost-pulled-token", "0"],
    "carryover-no-reuse": ["--no-reuse"],
    # Turns ending on a full D keep their pins: relief alone gives them back.
    "carryover-keep-pins": ["--decode-kv-pin-limit", "2"],
    # Another pin limit (``carryover-pin-limit:0.5``): no new pin on a D at that use or more.
    "carryover-pin-limit": ["--decode-kv-pin-limit", "0.8"],
    "carryover-unchecked": ["--planner", "carryover.bench.unchecked:plan_unchecked"],
    # Two worker processes sharing state in a local redis-server (started for the arm).
    "carryover-workers": ["--workers", "2"],
    # The same router, its engines without KV events: routed by load and last-turn affinity.
    "carryover-no-index": [],
    # Short turns run on the D that holds their history, without a P leg.
    "carryover-decode-local": ["--decode-local-max-tokens", "512"],
    # The index with another price of load in tokens (router/fleet/policy.py); 0: any holding wins.
    "carryover-tokens-per-load": ["--affinity-tokens-per-load", "0"],
    # The index with another slack: how much busier than the least loaded a holder may be.
    "carryover-affinity-slack": ["--affinity-slack", "0"],
    # Another fixed price of a pull (``carryover-pull-tokens:1000``; docs/turn-costs.md).
    "carryover-pull-tokens": ["--cost-pull-tokens", "32"],
    # Every P also reaches a simulated warm tier (LMCache's server, docs/warm-tier.md): a turn
    # without a handle loads what the tier holds of its history.
    "carryover-warm": [],
    "carryover-warm-no-index": [],
    # Tokens-only engines: a render server renders and derenders (docs/tokens-pipeline.md).
    "carryover-tokens": ["--engine-api", "tokens", "--reasoning-parser", "qwen3"],
    "colocated": None,
}
#: Arms whose engines run --tokens-only beside a render server.
TOKENS = frozenset({"carryover-tokens"})
#: Arms whose engines publish KV events that the router indexes (docs/kv-events.md).
INDEXED = frozenset(
    {
        "carryover",
        "carryover-always-pull",
        "carryover-keep-pins",
        "carryover-pin-limit",
        "carryover-workers",
        "carryover-unchecked",
        "carryover-decode-local",
        "carryover-tokens-per-load",
        "carryover-affinity-slack",
        "carryover-pull-tokens",
        "carryover-warm",
    }
)
#: Arms whose router keeps its state in a redis-server of their own.
REDIS = frozenset({"carryover-workers"})
#: Arms whose P engines share a simulated warm tier of this many tokens a chunk.
WARM = frozenset({"carryover-warm", "carryover-warm-no-index"})
WARM_CHUNK = 256
BASELINE = "carryover-no-reuse"
#: Arms that take their one setting after a colon (``carryover-decode-local:256``).
_SETTING: dict[str, tuple[str, type]] = {
    "carryover-decode-local": ("--decode-local-max-tokens", int),
    "carryover-tokens-per-load": ("--affinity-tokens-per-load", int),
    "carryover-affinity-slack": ("--affinity-slack", int),
    "carryover-pull-tokens": ("--cost-pull-tokens", int),
    "carryover-pin-limit": ("--decode-kv-pin-limit", float),
    "carryover-tokens": ("--stream-interval", float),
}


#: ``vllm-router:POLICY`` arms: vLLM Router in front of the same fleet (bench/peers.py).
PEER = "vllm-router"


def arm_flags(arm: str) -> list[str] | None:
    """The router flags of ``arm``; ``carryover-decode-local:N`` is that arm with N tokens as
    its threshold, ``carryover-tokens-per-load:N`` with N as its price of load,
    ``carryover-affinity-slack:N`` with N as its slack,
    ``carryover-tokens:S`` with streams derendered at least every S seconds (to measure
    several in one run)."""
    name, _, setting = arm.partition(":")
    if name == PEER:
        if setting not in POLICIES:
            raise ValueError(
                f"arm {arm!r}: vllm-router:POLICY, POLICY one of {', '.join(POLICIES)}"
            )
        return []
    if name in _SETTING and setting:
        flag, kind = _SETTING[name]
        flags = list(ARMS[name] or [])
        if flag in flags:  # the arm's own default of that setting
            del flags[flags.index(flag) : flags.index(flag) + 2]
        return [*flags, flag, str(kind(setting))]
    if setting or name not in ARMS:
        raise ValueError(f"unknown arm {arm!r}: one of {', '.join(ARMS)}")
    return ARMS[name]


def indexed(arm: str) -> bool:
    """Whether the arm's engines publish KV events (``INDEXED``, whatever its threshold)."""
    return arm.partition(":")[0] in INDEXED


@dataclass
class ArmResult:
    records: list[TurnRecord]
    wall: float
    # Prompt tokens by role and source, summed over the arm's engines ("decode/external_kv_transfer"
    # is what D pulled from P): the engines' own counters, not the router's view.
    sources: dict[str, float]
    command: str = ""  # the router's command line ("" for the colocated baseline)
    decode_kv: list[tuple[float, float, float, float]] = field(default_factory=list)
    relieved: float | None = None  # handles carryover gave back under KV pressure
    not_kept: float | None = None  # turns' pins carryover gave back at once: D was full
    router_cpu: dict[str, Any] | None = None  # CpuMeter.used: the router's process tree
    legs: dict[str, float] | None = None  # a carryover router's mean ms per step of a turn
    client_lag: dict[str, float] | None = None  # lag_summary of the load generator's loop
    #: The engines' processes' CPU, by role: ms a turn and share of one core over the run.
    engine_cpu: dict[str, dict[str, float]] | None = None
    retries: dict[str, float] | None = None  # a carryover router's retries, by cause
    #: A carryover router's own turn-N (fleet_counters.router_turns)
    router_turns: list[dict[str, Any]] | None = None


def _run_sim_arm(
    arm: str,
    conversations: list[Conversation],
    *,
    prefills: int,
    decodes: int,
    speed: float,
    sim_flags: Sequence[str],
    progress: bool,
    model: str,
    lifetimes: Lifetimes | None,
    placement: Placement,
    log_dir: Path,
) -> ArmResult:
    flags = arm_flags(arm)
    engines: list[tuple[str, Process]] = []
    name, _, policy = arm.partition(":")
    router: Process | None = None
    with (
        contextlib.ExitStack() as stack,
        placement.load_generator(),
        topology(placement, log_dir=log_dir) as topo,
    ):
        if name in REDIS and flags is not None:
            flags = [*flags, "--redis", stack.enter_context(local_redis())]
        if flags is None:
            engine = topo.sim("engine", None, speed=speed, extra=sim_flags)
            url, send_id = engine.url, False
            engines.append(("colocated", engine))
            command = ""
        elif name == PEER:
            # As its users run it: engines without bidirectional_kv_xfer (docs: bench/peers.py).
            events = policy == "kv_aware"
            ps = [
                topo.sim(
                    f"prefill-{i}",
                    "kv_producer",
                    speed=speed,
                    extra=sim_flags,
                    kv_events=events,
                    bidirectional=False,
                )
                for i in range(prefills)
            ]
            ds = [
                topo.sim(
                    f"decode-{i}", "kv_consumer", speed=speed, extra=sim_flags, bidirectional=False
                )
                for i in range(decodes)
            ]
            router = topo.peer(
                "peer", ensure_vllm_router(), vllm_router_args(policy, ps, ds, free_port())
            )
            url, send_id, command = router.url, False, " ".join(router.argv)
            engines += [("prefill", p) for p in ps] + [("decode", d) for d in ds]
        else:
            events = indexed(arm)
            if arm.partition(":")[0] in TOKENS:
                render = topo.sim_render("render", model=model, reasoning_parser="qwen3")
                flags = [*flags, "--render", render.url]
                sim_flags = [*sim_flags, "--tokens-only"]
            p_flags = list(sim_flags)
            if arm.partition(":")[0] in WARM:
                tier = topo.sim_warm_tier("warm-tier", chunk_tokens=WARM_CHUNK)
                p_flags += ["--sim-warm-tier", tier.url]
                flags = [
                    *flags,
                    *("--warm-tier", "lmcache", "--warm-tier-health", f"{tier.url}/healthcheck"),
                    *("--warm-tier-chunk-tokens", str(WARM_CHUNK)),
                ]
            lifetime_flags = lifetimes.engine_flags() if lifetimes else []
            ps = [
                topo.sim(
                    f"prefill-{i}",
                    "kv_producer",
                    speed=speed,
                    extra=[*p_flags, *lifetime_flags],
                    kv_events=events,
                )
                for i in range(prefills)
            ]
            ds = [
                topo.sim(
                    f"decode-{i}",
                    "kv_consumer",
                    speed=speed,
                    extra=[*sim_flags, *lifetime_flags],
                    kv_events=events,
                    extra_config=lifetimes.decode_config() if lifetimes else None,
                )
                for i in range(decodes)
            ]
            router_flags = lifetimes.router_flags() if lifetimes else []
            router = topo.router("router", ps, ds, *flags, *router_flags)
            url, send_id, command = router.url, True, " ".join(router.argv)
            engines += [("prefill", p) for p in ps] + [("decode", d) for d in ds]
        topo.wait()
        if router is not None and send_id:
            wait_rendering(router.url)
        decoding = [process for role, process in engines if role == "decode"]
        cpu = CpuMeter(router.popen.pid) if router is not None else None
        engine_meters = [(role, CpuMeter(process.popen.pid)) for role, process in engines]
        started = time.perf_counter()
        lags: list[float] = []
        passes: dict[str, list[float]] = {}
        with DecodeSampler([d.url for d in decoding]) as sampler:
            records = asyncio.run(
                run_arm(
                    arm,
                    url,
                    conversations,
                    model=model,
                    send_conversation_id=send_id,
                    session_header=name == PEER,
                    progress=progress,
                    loop_lag=lags,
                    collections=passes,
                )
            )
        wall = time.perf_counter() - started
        router_metrics = scrape(url) if send_id else None  # one read for all that follows
        relieved, not_kept = (
            pressure_releases(router_metrics) if router_metrics is not None else (None, None)
        )
        return ArmResult(
            records,
            wall,
            prompt_sources(engines),
            command,
            sampler.samples,
            relieved,
            not_kept,
            None if cpu is None else cpu.used(wall, turns=len(records)),
            leg_means(router_metrics) if router_metrics is not None else None,
            lag_summary(lags, passes),
            engines_cpu(engine_meters, wall, turns=len(records)),
            retries(router_metrics) if router_metrics is not None else None,
            router_turns(router_metrics) if router_metrics is not None else None,
        )


def run_arms(
    conversations: list[Conversation],
    arms: Sequence[str],
    *,
    out: Path,
    slo: Slo,
    prefills: int = 2,
    decodes: int = 2,
    speed: float = 1.0,
    sim_flags: Sequence[str] = (),
    targets: dict[str, str] | None = None,
    model: str = "sim-qwen3",
    progress: bool = True,
    meta: dict[str, Any] | None = None,
    lifetimes: Lifetimes | None = None,
    placement: Placement | None = None,
) -> dict[str, Any]:
    """Every arm in ``arms`` runs on its own fresh simulated topology; ``targets`` maps extra arm
    names to already running endpoints (a router in front of real vLLM, say). ``lifetimes``:
    D's TTL and P's margin for carryover's arms (None: vLLM's). Each arm's processes log to
    ``out/logs/ARM/``."""
    records: list[TurnRecord] = []
    walls: dict[str, float] = {}
    sources: dict[str, dict[str, float]] = {}
    commands: dict[str, str] = {}
    decode_kv: dict[str, dict[str, Any]] = {}
    router_cpu: dict[str, dict[str, Any]] = {}
    legs: dict[str, dict[str, float]] = {}
    client_lag: dict[str, dict[str, float]] = {}
    engine_cpu: dict[str, dict[str, dict[str, float]]] = {}
    retried: dict[str, dict[str, float]] = {}
    own_turns: dict[str, list[dict[str, Any]]] = {}
    report: dict[str, Any] = {}

    def written(arm: str) -> None:
        """The report of the arms so far, written after each: a run stopped later (an engine
        that hangs, a deadline) keeps the arms that finished."""
        nonlocal report
        baseline = BASELINE if BASELINE in walls else None
        report = build_report(
            records, baseline_arm=baseline, slo=slo, wall_seconds=walls, meta=meta, sources=sources
        )
        report["commands"] = commands
        report["decode_kv"] = decode_kv
        report["router_cpu"] = router_cpu
        report["router_legs"] = legs
        report["client_lag"] = client_lag
        report["engine_cpu"] = engine_cpu
        report["router_retries"] = retried
        report["router_turns"] = own_turns
        report["files"] = {k: str(v) for k, v in write_report(report, records, out).items()}
        if progress:
            print(f"  {arm}: done, report so far in {out}", file=sys.stderr)

    for arm in arms:
        result = _run_sim_arm(
            arm,
            conversations,
            prefills=prefills,
            decodes=decodes,
            speed=speed,
            sim_flags=sim_flags,
            progress=progress,
            model=model,
            lifetimes=lifetimes,
            placement=placement or Placement(),
            log_dir=out / "logs" / arm,
        )
        records += result.records
        walls[arm] = result.wall
        sources[arm] = result.sources
        commands[arm] = result.command
        if result.router_cpu is not None:
            router_cpu[arm] = result.router_cpu
        if result.legs is not None:
            legs[arm] = result.legs
        if result.client_lag is not None:
            client_lag[arm] = result.client_lag
        if result.engine_cpu is not None:
            engine_cpu[arm] = result.engine_cpu
        if result.retries is not None:
            retried[arm] = result.retries
        if result.router_turns is not None:
            own_turns[arm] = result.router_turns
        usage = [u for _, u, _, _ in result.decode_kv]
        pinned_usage = [u for _, _, _, u in result.decode_kv]
        decode_kv[arm] = {
            "kv_usage_mean": sum(usage) / len(usage) if usage else None,
            "kv_usage_peak": max(usage, default=None),
            "pinned_usage_peak": max(pinned_usage, default=None),
            "pinned_handles_peak": max((p for _, _, p, _ in result.decode_kv), default=None),
            "relieved_handles": result.relieved,
            "pins_not_kept": result.not_kept,
            "samples": result.decode_kv,
        }
        written(arm)
    for arm, url in (targets or {}).items():
        started = time.perf_counter()
        records += asyncio.run(run_arm(arm, url, conversations, model=model, progress=progress))
        walls[arm] = time.perf_counter() - started
        written(arm)
    return report
