"""Instructions the router executes per turn, counted by callgrind.

CPU seconds per turn on a shared two-core machine move by ±15% between identical runs
(``bench/RESULTS.md``), so a change worth a few percent needs many alternating rounds to show.
An instruction count does not depend on what else the machine is doing: the same checkout
gives the same count to about 0.1%. It is not time (a cache miss or a system call costs more
than its instructions, and the kernel's work is not counted), so it complements the CPU
seconds of ``carryover bench overhead``; it does not replace them.

The router runs under ``valgrind --tool=callgrind --instr-atstart=no`` with
``PYTHONHASHSEED=0`` in front of zero-delay simulated P and D (in-process state, or Redis
with ``redis=True``). Instrumentation is switched on with ``callgrind_control`` for the
measured turns only, after a warm-up, so startup runs at near native speed. Turns go one at a
time (concurrency 1), with the requests of ``carryover bench overhead``, and health probes
every 30 s, so that their share does not grow with valgrind's slowdown.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import httpx

from carryover.bench.loadgen import closed_loop
from carryover.bench.local_redis import local_redis
from carryover.bench.overhead import LONG, MODES, decode_sim_options, jobs_for
from carryover.bench.ports import free_port
from carryover.bench.procs import Process, kv_event_flags, topology

__all__ = ["render_instructions", "run_instructions"]

_WARM_UP = 40


def _callgrind_total(dump: Path) -> int:
    for line in dump.read_text(errors="replace").splitlines():
        if line.startswith("totals:"):
            return int(line.split()[1])
    raise RuntimeError(f"no totals in {dump}")


@contextlib.contextmanager
def _router_under_callgrind(
    prefill: Process, decode: Process, flags: Sequence[str], out_dir: Path
) -> Iterator[tuple[str, subprocess.Popen[bytes], Path]]:
    port = free_port()
    dump = out_dir / "callgrind.out"
    argv = [
        "valgrind",
        "--tool=callgrind",
        "--instr-atstart=no",
        f"--callgrind-out-file={dump}",
        sys.executable,
        "-m",
        "carryover",
        "serve",
        "--port",
        str(port),
        "--log-level",
        "warning",
        "--health-interval",
        "30",
        "--held-interval",
        "600",
        "--prefill",
        prefill.url,
        "--decode",
        decode.url,
        *flags,
    ]
    env = {**os.environ, "PYTHONHASHSEED": "0"}
    with open(out_dir / "valgrind.log", "ab") as log:
        popen = subprocess.Popen(
            argv, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
    try:
        yield f"http://127.0.0.1:{port}", popen, dump
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(popen.pid, signal.SIGTERM)
        try:
            popen.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(popen.pid, signal.SIGKILL)
            popen.wait()


def _wait_ready(url: str, popen: subprocess.Popen[bytes], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url + "/ready", timeout=5).status_code == 200:
                return
        if popen.poll() is not None:
            raise RuntimeError("the router under callgrind exited; see valgrind.log")
        time.sleep(0.5)
    raise RuntimeError(f"the router under callgrind was not ready within {timeout:g} s")


def _count(url: str, pid: int, dump: Path, mode: str, turns: int) -> dict[str, Any]:
    asyncio.run(closed_loop(url, jobs_for(mode, _WARM_UP, conversation=True), 1))
    subprocess.run(["callgrind_control", "--instr=on", str(pid)], check=True, capture_output=True)
    samples, _ = asyncio.run(closed_loop(url, jobs_for(mode, turns, conversation=True), 1))
    subprocess.run(["callgrind_control", "--instr=off", str(pid)], check=True, capture_output=True)
    for stale in dump.parent.glob(dump.name + ".*"):
        stale.unlink()
    subprocess.run(["callgrind_control", "--dump", str(pid)], check=True, capture_output=True)
    dumps = sorted(dump.parent.glob(dump.name + ".*"), key=lambda p: p.stat().st_mtime)
    if not dumps:
        raise RuntimeError("callgrind wrote no dump")
    return {  # closed_loop raises on any answer but a 200
        "mode": mode,
        "turns": len(samples),
        "instructions_per_turn": _callgrind_total(dumps[-1]) / len(samples),
    }


def run_instructions(
    out: Path,
    *,
    modes: Sequence[str] = MODES,
    turns: int = 300,
    redis: bool = False,
    ready_timeout: float = 600.0,
) -> dict[str, Any]:
    """Instructions per turn for each mode, one router per mode; written to ``out``."""
    if shutil.which("valgrind") is None or shutil.which("callgrind_control") is None:
        raise RuntimeError("valgrind is not installed (Debian: apt-get install valgrind)")
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    stack = contextlib.ExitStack()
    with stack, topology() as topo:
        flags: list[str] = []
        if redis:
            flags = ["--redis", stack.enter_context(local_redis())]
        prefill = topo.sim("prefill", "kv_producer", speed=0, kv_events=True)
        decode = topo.sim("decode", "kv_consumer", speed=0, kv_events=True, **decode_sim_options())
        topo.wait()
        for mode in modes:
            # The long conversation's router follows the engines' KV events, as a fleet's
            # does: at 20k tokens the index's work is part of a turn's.
            events = kv_event_flags(prefill, decode) if mode == LONG else []
            with _router_under_callgrind(prefill, decode, [*flags, *events], out) as (
                url,
                popen,
                dump,
            ):
                _wait_ready(url, popen, ready_timeout)
                rows.append(_count(url, popen.pid, dump, mode, turns))
    results = {"store": "redis" if redis else "memory", "rows": rows}
    (out / "instructions.json").write_text(json.dumps(results, indent=2))
    (out / "instructions.md").write_text(render_instructions(results))
    return results


def render_instructions(results: dict[str, Any]) -> str:
    lines = [
        f"# Router instructions per turn (callgrind, {results['store']} state, concurrency 1)",
        "",
        "| mode | turns | instructions per turn |",
        "|---|---|---|",
    ]
    for row in results["rows"]:
        lines.append(f"| {row['mode']} | {row['turns']} | {row['instructions_per_turn']:,.0f} |")
    return "\n".join(lines) + "\n"
