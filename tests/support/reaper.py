"""Every process a test run starts dies with the run, however the run ends.

Fixtures stop what they start, but a run killed by SIGTERM, SIGKILL or a CI timeout runs no
finalizer, and servers started in their own sessions (routers with their uvicorn workers,
vLLM with its engine-core children) then outlive it. This plugin marks the run: it puts a
unique ``CARRYOVER_TEST_RUN`` value into the environment, which every descendant inherits,
and starts a watchdog in a session of its own. When the pytest process is gone (a pidfd
becomes readable: no polling), the watchdog finds every process whose environment carries
the mark, sends SIGTERM, and SIGKILL to what is left after a grace period. Programs that
retitle themselves over their environment are asked not to: py-setproctitle by ``SPT_NOENV``
here, redis-server by ``set-proc-title no`` (``bench/redis_server.py``).

``tests/conftest.py`` starts it for every run (so does ``-p tests.support.reaper``);
``python -m tests.support.reaper PID MARK`` is the watchdog.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

MARK_VARIABLE = "CARRYOVER_TEST_RUN"
GRACE_SECONDS = 10.0
_KEEP_ENVIRONMENT = "SPT_NOENV"
_WATCHDOG = pytest.StashKey[subprocess.Popen[bytes]]()


def marked_pids(mark: str) -> list[int]:
    """Processes whose initial environment holds ``CARRYOVER_TEST_RUN=mark``."""
    needle = f"{MARK_VARIABLE}={mark}".encode()
    found: list[int] = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            environ = (entry / "environ").read_bytes()
        except OSError:  # gone meanwhile, or not ours to read
            continue
        if needle in environ.split(b"\0"):
            found.append(int(entry.name))
    return found


def sweep(mark: str, grace: float = GRACE_SECONDS) -> list[int]:
    """SIGTERM every marked process, SIGKILL the survivors after ``grace``; returns who was hit."""
    hit = marked_pids(mark)
    exits: list[int] = []  # pidfds: readable once their process is gone
    for pid in hit:
        with contextlib.suppress(ProcessLookupError):
            exits.append(os.pidfd_open(pid))
        _signal(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while exits and (left := deadline - time.monotonic()) > 0:
        gone, _, _ = select.select(exits, [], [], left)
        for fd in gone:
            exits.remove(fd)
            os.close(fd)
    for fd in exits:
        os.close(fd)
    for pid in marked_pids(mark):
        _signal(pid, signal.SIGKILL)
    return hit


def _signal(pid: int, signum: signal.Signals) -> None:
    try:
        os.kill(pid, signum)
    except ProcessLookupError:
        pass


def watch(parent: int, mark: str) -> None:
    """Block until ``parent`` exits, then sweep the run's processes."""
    try:
        fd = os.pidfd_open(parent)
    except ProcessLookupError:
        pass
    else:
        select.select([fd], [], [])
        os.close(fd)
    sweep(mark)


def pytest_configure(config: pytest.Config) -> None:
    start_watchdog(config)


def start_watchdog(config: pytest.Config) -> None:
    """Mark this run and start its watchdog (a nested run marks its own children anew)."""
    if _WATCHDOG in config.stash:
        return
    mark = uuid.uuid4().hex
    os.environ[MARK_VARIABLE] = mark
    # py-setproctitle (vLLM titles its processes with it) writes the title over the memory
    # /proc/PID/environ shows unless this is set: the mark would vanish with it.
    os.environ[_KEEP_ENVIRONMENT] = "1"
    environment = {k: v for k, v in os.environ.items() if k != MARK_VARIABLE}
    watchdog = subprocess.Popen(
        [sys.executable, "-m", "tests.support.reaper", str(os.getpid()), mark],
        env=environment,
        cwd=Path(__file__).parents[2],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,  # a signal to pytest's process group does not reach it
    )
    config.stash[_WATCHDOG] = watchdog


if __name__ == "__main__":
    watch(int(sys.argv[1]), sys.argv[2])
