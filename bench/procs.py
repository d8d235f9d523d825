"""Start and stop simulated engines and routers as real processes on loopback ports."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from carryover.bench.placement import Placement
from carryover.bench.ports import free_port

__all__ = ["Process", "Topology", "free_port", "kv_event_flags", "topology", "wait_ready"]


@dataclass
class Process:
    name: str
    url: str
    popen: subprocess.Popen[bytes]
    log: Path
    kv_events: tuple[str, str] | None = None  # (events, replay) endpoints, when it publishes
    argv: list[str] = field(default_factory=list)  # how it was started

    def stop(self) -> None:
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGINT)
            try:
                self.popen.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(self.popen.pid, signal.SIGKILL)  # whatever of the group is left
        except ProcessLookupError:
            pass
        self.popen.wait()


@contextlib.contextmanager
def _termination_deferred() -> Iterator[None]:
    """Hold SIGTERM while a child is started and recorded: a handler that raised inside
    ``Popen`` (after the fork) would leave a child in its own session that no cleanup knows."""
    if threading.current_thread() is not threading.main_thread():
        yield  # signal handlers run on the main thread only
        return
    received: list[int] = []
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: received.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL if previous is None else previous)
        if received:
            signal.raise_signal(signal.SIGTERM)


def wait_ready(process: Process, path: str, timeout: float) -> None:
    """Until ``process`` answers 200 on ``path``; its log's tail in the error if it exits."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.popen.poll() is not None:
            raise RuntimeError(f"{process.name} exited:\n{process.log.read_text()[-2000:]}")
        try:
            if httpx.get(process.url + path, timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.05)
    raise RuntimeError(f"{process.name} did not become ready:\n{process.log.read_text()[-2000:]}")


@dataclass
class Topology:
    """Processes started for one benchmark or demo run; all stopped on exit. Each writes its
    log to ``log_dir`` (one file a process)."""

    log_dir: Path
    processes: list[Process] = field(default_factory=list)
    #: Where the simulated engines (and their render server and warm tier) and the routers
    #: run: engines stand in for GPUs on hosts of their own (bench/placement.py).
    placement: Placement = field(default_factory=Placement)

    def _spawn(
        self,
        name: str,
        args: Sequence[str],
        env: dict[str, str] | None = None,
        command: Sequence[str] = (sys.executable, "-m", "carryover"),
    ) -> Process:
        port = int(args[args.index("--port") + 1])
        log = self.log_dir / f"{name}.log"
        handle = open(log, "ab")  # noqa: SIM115 - owned by the child
        with _termination_deferred():
            popen = subprocess.Popen(
                [*command, *args],
                stdout=handle,
                stderr=subprocess.STDOUT,
                env={**os.environ, **(env or {}), "PYTHONUNBUFFERED": "1"},
                start_new_session=True,  # a router's uvicorn workers are its children
            )
            process = Process(name, f"http://127.0.0.1:{port}", popen, log, argv=[*command, *args])
            self.processes.append(process)
        return process

    def sim(
        self,
        name: str,
        role: str | None,
        *,
        model: str = "sim-qwen3",
        bidirectional: bool = True,
        speed: float = 1.0,
        extra: Sequence[str] = (),
        extra_config: dict[str, Any] | None = None,
        kv_events: bool = False,
        port: int | None = None,
    ) -> Process:
        port = port or free_port()
        args = ["sim", model, "--port", str(port), "--sim-speed", str(speed), *extra]
        events: tuple[str, str] | None = None
        if kv_events:
            events = (f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}")
            settings = {
                "enable_kv_cache_events": True,
                "publisher": "zmq",
                "endpoint": events[0],
                "replay_endpoint": events[1],
            }
            args += ["--kv-events-config", json.dumps(settings)]
        env = {
            "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1",
            "VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port()),
        }
        if role is not None:
            config = {
                "kv_connector": "NixlConnector",
                "kv_role": role,
                "kv_load_failure_policy": "fail",
                "kv_connector_extra_config": {
                    "bidirectional_kv_xfer": bidirectional,
                    **(extra_config or {}),
                },
            }
            args += ["--kv-transfer-config", json.dumps(config)]
        process = self._spawn(name, args, env, command=self._engine_command())
        process.kv_events = events
        return process

    def _engine_command(self) -> tuple[str, ...]:
        return self.placement.engine_command((sys.executable, "-m", "carryover"))

    def sim_render(
        self, name: str, *, model: str = "sim-qwen3", reasoning_parser: str | None = None
    ) -> Process:
        """A simulated render server for ``--tokens-only`` simulated engines."""
        args = ["sim-render", model, "--port", str(free_port())]
        if reasoning_parser is not None:
            args += ["--reasoning-parser", reasoning_parser]
        return self._spawn(name, args, command=self._engine_command())

    def sim_warm_tier(self, name: str, *, chunk_tokens: int = 256) -> Process:
        """A simulated warm KV tier (LMCache's server) for engines given ``--sim-warm-tier``."""
        args = ["sim-warm-tier", "--port", str(free_port()), "--chunk-tokens", str(chunk_tokens)]
        return self._spawn(name, args, command=self._engine_command())

    def router(
        self,
        name: str,
        prefill: Sequence[Process],
        decode: Sequence[Process],
        *flags: str,
        entry: Sequence[str] = ("-m", "carryover", "serve"),
    ) -> Process:
        """A router in front of ``prefill`` and ``decode``; ``entry`` is what runs it
        (another module for a router built with other parts, e.g. bench/churn_router.py)."""
        args = [
            "--port",
            str(free_port()),
            "--expose-path-header",
            "--log-level",
            "warning",
        ]
        for p in prefill:
            args += ["--prefill", p.url]
        for d in decode:
            args += ["--decode", d.url]
        args += kv_event_flags(*prefill, *decode)
        command = self.placement.router_command((sys.executable, *entry))
        return self._spawn(name, [*args, *flags], command=command)

    def peer(self, name: str, binary: Path, args: Sequence[str]) -> Process:
        """Another router (``bench/peers.py``), started from its own binary."""
        return self._spawn(name, args, command=self.placement.router_command((str(binary),)))

    def wait(self, timeout: float = 180.0) -> None:
        for process in self.processes:
            wait_ready(process, "/health", timeout)
        for process in self.processes:
            if process.name.startswith("router"):
                wait_ready(process, "/ready", timeout)

    def stop(self) -> None:
        for process in reversed(self.processes):
            process.stop()
        self.processes.clear()


def kv_event_flags(*engines: Process) -> list[str]:
    """A router's flags for the KV events of those ``engines`` that publish them."""
    flags: list[str] = []
    for engine in engines:
        if engine.kv_events is not None:
            flags += ["--kv-events", f"{engine.url}={engine.kv_events[0]}"]
            flags += ["--kv-events-replay", f"{engine.url}={engine.kv_events[1]}"]
    return flags


@contextlib.contextmanager
def topology(
    placement: Placement | None = None, *, log_dir: Path | None = None
) -> Iterator[Topology]:
    """Processes stopped on exit. Their logs go to ``log_dir`` (kept), or to a temporary
    folder that is removed after a run that raised nothing, and kept and named on stderr
    after one that did: the logs are what a failed run's post-mortem reads."""
    folder = log_dir or Path(tempfile.mkdtemp(prefix="carryover-"))
    folder.mkdir(parents=True, exist_ok=True)
    topo = Topology(folder, placement=placement or Placement())
    try:
        yield topo
    except BaseException:
        topo.stop()
        if log_dir is None:
            print(f"the stopped processes' logs: {folder}", file=sys.stderr)
        raise
    topo.stop()
    if log_dir is None:
        shutil.rmtree(folder, ignore_errors=True)
