"""Run the same multi-turn workload against several arms, each on fresh engines."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.procs import topology
from bench.report import Slo, build_report, write_report
from bench.runner import TurnRecord, run_arm
from bench.workload import Conversation

__all__ = ["ARMS", "ArmResult", "run_arms"]

#: Router flags per arm; ``None`` is the colocated baseline (one engine, both phases, no router).
ARMS: dict[str, list[str] | None] = {
    "carryover": [],
    "carryover-no-reuse": ["--no-reuse"],
    "carryover-unchecked": ["--planner", "bench.unchecked:plan_unchecked"],
    # The same router, its engines without KV events: routed by load and last-turn affinity.
    "carryover-no-index": [],
    # Short turns run on the D that holds their history, without a P leg.
    "carryover-decode-local": ["--decode-local-max-tokens", "512"],
    "colocated": None,
}
#: Arms whose engines publish KV events that the router indexes (docs/kv-events.md).
INDEXED = frozenset({"carryover", "carryover-unchecked", "carryover-decode-local"})
BASELINE = "carryover-no-reuse"


@dataclass
class ArmResult:
    records: list[TurnRecord]
    wall: float


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
) -> ArmResult:
    flags = ARMS[arm]
    with topology() as topo:
        if flags is None:
            engine = topo.sim("engine", None, speed=speed, extra=sim_flags)
            url, send_id = engine.url, False
        else:
            events = arm in INDEXED
            ps = [
                topo.sim(
                    f"prefill-{i}", "kv_producer", speed=speed, extra=sim_flags, kv_events=events
                )
                for i in range(prefills)
            ]
            ds = [
                topo.sim(
                    f"decode-{i}", "kv_consumer", speed=speed, extra=sim_flags, kv_events=events
                )
                for i in range(decodes)
            ]
            router = topo.router("router", ps, ds, *flags)
            url, send_id = router.url, True
        topo.wait()
        started = time.perf_counter()
        records = asyncio.run(
            run_arm(
                arm,
                url,
                conversations,
                model=model,
                send_conversation_id=send_id,
                progress=progress,
            )
        )
        return ArmResult(records, time.perf_counter() - started)


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
) -> dict[str, Any]:
    """Every arm in ``arms`` runs on its own fresh simulated topology; ``targets`` maps extra arm
    names to already running endpoints (a router in front of real vLLM, say)."""
    records: list[TurnRecord] = []
    walls: dict[str, float] = {}
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
        )
        records += result.records
        walls[arm] = result.wall
    for arm, url in (targets or {}).items():
        started = time.perf_counter()
        records += asyncio.run(run_arm(arm, url, conversations, model=model, progress=progress))
        walls[arm] = time.perf_counter() - started
    baseline = BASELINE if BASELINE in walls else None
    report = build_report(records, baseline_arm=baseline, slo=slo, wall_seconds=walls, meta=meta)
    report["files"] = {k: str(v) for k, v in write_report(report, records, out).items()}
    return report
