"""LMCache as the real tier's warm tier: its environment, its server, and the engines'
connector config (docs/warm-tier.md).

- The environment sees the real tier's packages through a ``.pth`` file (the tier itself is
  untouched) and adds LMCache's wheel without its CUDA dependencies.
- ``LmcacheServer`` is a standalone ``lmcache server`` process; engines reach it with
  LMCache's multi-process connector (``LMCacheMPConnector``), the only LMCache connector that
  runs on vLLM's CPU build.
- ``multi_connector`` composes NIXL (P/D, bidirectional) with LMCache in vLLM's
  ``MultiConnector``.
"""

from __future__ import annotations

import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from carryover.bench.ports import free_port
from carryover.bench.real.env import ensure_env, env_dir
from carryover.bench.real.process import StartTimedOut, offline_env, spawn, stop_group

__all__ = ["CHUNK", "LMCACHE", "LmcacheServer", "ensure_lmcache_env", "multi_connector"]

LMCACHE = "0.5.6"
# What LMCache's CPU path imports beyond vLLM's environment (its wheel's other pins are CUDA
# packages and older numpy/protobuf/prometheus-client than vLLM's; nothing here needs them).
_EXTRA = ("sortedcontainers", "aiofile", "aiofiles", "caio")
CHUNK = 256  # LMCache stores whole chunks of this many tokens


def ensure_lmcache_env() -> Path:
    """The python of an environment that sees the real tier's packages plus LMCache."""
    base = ensure_env()
    root = env_dir().parent / f"lmcache-{LMCACHE}-on-{env_dir().name}"
    python = root / "bin" / "python"
    if (root / ".ready").exists():
        return python
    interpreter = _ask(base, "import sys; print(sys._base_executable)")
    subprocess.run([interpreter, "-m", "venv", "--clear", str(root)], check=True)
    purelib = "import sysconfig; print(sysconfig.get_paths()['purelib'])"
    (Path(_ask(python, purelib)) / "_vllm_env.pth").write_text(_ask(base, purelib) + "\n")
    pip = [str(python), "-m", "pip", "install", "--quiet", "--no-deps"]
    subprocess.run([*pip, f"lmcache=={LMCACHE}", *_EXTRA], check=True)
    (root / ".ready").write_text(f"lmcache {LMCACHE} over {env_dir().name}\n")
    return python


def _ask(python: Path, code: str) -> str:
    """What ``code`` prints in that environment."""
    ran = subprocess.run([str(python), "-c", code], check=True, capture_output=True, text=True)
    return ran.stdout.strip()


@dataclass
class LmcacheServer:
    """One ``lmcache server``: engines connect to ``port`` (ZMQ), ``health`` is its HTTP
    health check. ``start`` and ``stop`` may be called again (the same ports)."""

    log: Path
    port: int = field(default_factory=free_port)
    http_port: int = field(default_factory=free_port)
    popen: subprocess.Popen[bytes] | None = None

    @property
    def health(self) -> str:
        return f"http://127.0.0.1:{self.http_port}/healthcheck"

    def start(self, timeout: float = 180.0) -> None:
        python = ensure_lmcache_env()
        args = [
            # Not lowered like the engines: a server that answers a ping late fails every load
            # in flight (``multi_connector``).
            *(str(python), "-m", "lmcache.cli.main", "server"),
            *("--host", "127.0.0.1", "--port", str(self.port), "--chunk-size", str(CHUNK)),
            # Without these the server refuses the legacy L1 settings, misses an OpenTelemetry
            # exporter, or never registers a CPU engine (vLLM's start then hangs).
            *("--l1-size-gb", "1", "--eviction-policy", "LRU", "--disable-observability"),
            *("--supported-transfer-mode", "auto"),
            # An engine step on two loaded cores can outlast the default: a reaped engine's
            # stores are answered with nothing, and it waits for its mq_timeout.
            *("--worker-reap-timeout-seconds", "3600"),
            *("--http-port", str(self.http_port), "--prometheus-port", str(free_port())),
        ]
        self.popen = spawn(args, self.log, offline_env())
        deadline = time.monotonic() + timeout
        while not self.healthy():
            if self.popen.poll() is not None:
                tail = self.log.read_text(errors="replace")[-3000:]
                raise RuntimeError(f"the LMCache server exited during start:\n{tail}")
            if time.monotonic() > deadline:
                self.stop()
                raise StartTimedOut(f"the LMCache server did not start in time ({self.log})")
            time.sleep(0.5)

    def healthy(self) -> bool:
        try:
            return httpx.get(self.health, timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def stop(self) -> None:
        if self.popen is not None:
            stop_group(self.popen, timeout=30)
            self.popen = None


def multi_connector(
    nixl: dict[str, Any],
    server: LmcacheServer,
    *,
    mq_timeout: float = 60.0,
    heartbeat: float = 30.0,
    **lmcache_extra: Any,
) -> dict[str, Any]:
    """An engine's ``--kv-transfer-config``: ``nixl`` (the tier's own NIXL config) first, then
    LMCache. ``MultiConnector`` gives a request to the first connector that reports matched
    tokens, so a handle's pull wins and LMCache serves turns without one. ``lmcache_extra``:
    more of the LMCache connector's settings (``lmcache.mp.…``)."""
    lmcache = {
        "kv_connector": "LMCacheMPConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {
            "lmcache.mp.host": "tcp://127.0.0.1",
            "lmcache.mp.port": server.port,
            # Not 300 s: a request whose store the server never answers fails sooner.
            "lmcache.mp.mq_timeout": mq_timeout,
            # One ping unanswered within this (10 s by default) puts the connector in degraded
            # mode, which fails the loads in flight; under vLLM 0.32's MultiConnector a failed
            # load kills the engine (docs/warm-tier.md). A starved server answers late here.
            # But a dead server stalls the engine's step for about four heartbeats, and vLLM
            # kills an engine whose step outlasts 300 s: 60 s took 259 s once, and over 300 s
            # in a CI run. 30 s keeps both margins.
            "lmcache.mp.heartbeat_interval": heartbeat,
            **lmcache_extra,
        },
    }
    config: dict[str, Any] = {
        "kv_connector": "MultiConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"connectors": [nixl, lmcache]},
    }
    if "kv_load_failure_policy" in nixl:
        config["kv_load_failure_policy"] = nixl["kv_load_failure_policy"]
    return config
