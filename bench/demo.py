"""``make demo``: two simulated prefill and two decode instances, the router with in-process
state, a 5-turn workload with and without reuse, and the turn-by-turn TTFT report."""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from carryover.bench.multiturn import run_arms
from carryover.bench.report import Slo, render_markdown
from carryover.bench.workload import Distribution, WorkloadSpec, generate


def main(argv: Sequence[str] = ()) -> None:
    parser = argparse.ArgumentParser(
        prog="carryover demo",
        description="Simulated P/D engines and a router with in-process state: the same "
        "multi-turn workload with and without reuse, and a turn-by-turn TTFT report.",
    )
    parser.add_argument(
        "out", nargs="?", type=Path, default=Path("results/demo"), help="default results/demo"
    )
    out: Path = parser.parse_args(list(argv)).out
    spec = WorkloadSpec(
        conversations=16,
        turns=5,
        system_tokens=Distribution("constant", 300),
        user_tokens=Distribution("uniform", low=600, high=1000),
        output_tokens=Distribution("constant", 60),
        reasoning_share=0.25,
        arrival="poisson",
        rate=4.0,
        seed=7,
    )
    print(
        "carryover demo: 2 prefill + 2 decode simulated engines (8B-on-H100-like timing), "
        f"router with in-process state; {spec.conversations} conversations x {spec.turns} turns, "
        f"{int(spec.reasoning_share * 100)}% on the Qwen3 reasoning template",
        flush=True,
    )
    started = time.monotonic()
    report = run_arms(
        generate(spec),
        ["carryover", "carryover-no-reuse"],
        out=out,
        slo=Slo.parse("ttft=500ms,itl=50ms"),
        meta={"workload": "demo", "conversations": spec.conversations, "turns": spec.turns},
        progress=sys.stderr.isatty(),
    )
    print()
    print(render_markdown(report))
    print(f"Plot: {report['files']['plot']}   Data: {report['files']['json']}")
    print(f"Finished in {time.monotonic() - started:.0f} s; every process it started is stopped.")
