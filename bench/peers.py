"""vLLM Router, the router users would otherwise run, as an arm of the multi-turn and fleet
benchmarks: installed once into an environment of its own (the benchmark's setup step; never
a dependency of carryover) and started as a process in front of the same simulated fleet.

Its engines run as its users would run them: without ``bidirectional_kv_xfer`` (a router
that never gives handles back would leave D's pins to expire). Its P/D mode takes each P and
D by URL; ``consistent_hash`` keys on the ``X-Session-ID`` header, which the benchmark's
client sends with every turn of a conversation; ``kv_aware`` reads the prefill engines' KV
events (``--pd-kv-events URL=ENDPOINT``)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

from carryover.bench.procs import Process

__all__ = ["POLICIES", "VERSION", "ensure_vllm_router", "vllm_router_args"]

VERSION = "0.1.17"
#: The P/D policies the fleet benchmark runs (``vllm-router:POLICY`` arms).
POLICIES = ("round_robin", "consistent_hash", "cache_aware", "kv_aware")


def _folder() -> Path:
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
    return cache / "carryover" / "peers" / f"vllm-router-{VERSION}"


def ensure_vllm_router() -> Path:
    """The ``vllm-router`` binary, installed from the package index on first use."""
    folder = _folder()
    binary = folder / "bin" / "vllm-router"
    if binary.exists():
        return binary
    subprocess.run([sys.executable, "-m", "venv", str(folder)], check=True)
    subprocess.run(
        [
            str(folder / "bin" / "python"),
            "-m",
            "pip",
            "install",
            "--quiet",
            "--disable-pip-version-check",
            f"vllm-router=={VERSION}",
        ],
        check=True,
    )
    return binary


def vllm_router_args(
    policy: str, prefill: Sequence[Process], decode: Sequence[Process], port: int
) -> list[str]:
    """Its command line in P/D mode with ``policy`` for both legs."""
    if policy not in POLICIES:
        raise ValueError(f"vllm-router policy {policy!r}: one of {', '.join(POLICIES)}")
    args = ["--host", "127.0.0.1", "--port", str(port), "--vllm-pd-disaggregation"]
    args += ["--policy", policy, "--log-level", "warning"]
    for p in prefill:
        args += ["--prefill", p.url]
    for d in decode:
        args += ["--decode", d.url]
    if policy == "kv_aware":
        for p in prefill:
            if p.kv_events is not None:
                args += ["--pd-kv-events", f"{p.url}={p.kv_events[0]}"]
    return args
