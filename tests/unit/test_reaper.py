"""A test run that is killed takes every process it started with it (tests/support/reaper.py)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.waiting import ConditionTimeout, eventually_sync

ROOT = Path(__file__).parents[2]

# A test that starts a server-like child in a session of its own (as the router and vLLM
# fixtures do, so that a signal to the run's process group misses it), then hangs.
HANGING_TEST = """
import os, subprocess, threading
from pathlib import Path

def test_hangs_with_a_child():
    child = subprocess.Popen(["sleep", "1000"], start_new_session=True)
    Path(os.environ["CHILD_PID_FILE"]).write_text(str(child.pid))
    threading.Event().wait()  # a hung test: waits for nothing; the outer test kills this run
"""


def alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"  # a zombie is dead, only not reaped


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGKILL])
def test_children_of_a_killed_run_die(tmp_path: Path, signum: signal.Signals) -> None:
    (tmp_path / "test_hang.py").write_text(HANGING_TEST)
    pid_file = tmp_path / "child.pid"
    output = tmp_path / "inner-run.log"  # what the inner run printed, for the failure message
    with output.open("wb") as sink:
        run = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "pytest",
                "-q",
                "-p",
                "tests.support.reaper",
                "-p",
                "no:cacheprovider",
                "--rootdir",
                str(tmp_path),
                str(tmp_path / "test_hang.py"),
            ],
            cwd=ROOT,
            env={**os.environ, "CHILD_PID_FILE": str(pid_file)},
            stdin=subprocess.DEVNULL,
            stdout=sink,
            stderr=subprocess.STDOUT,
        )

    def started_child() -> str:
        if run.poll() is not None:  # it ended before its test hung: nothing to wait for
            raise AssertionError(
                f"the inner run exited {run.returncode}:\n{output.read_text(errors='replace')}"
            )
        return pid_file.read_text() if pid_file.exists() else ""

    child = 0
    try:
        try:
            child = int(
                eventually_sync(started_child, what="the inner run starts its child", timeout=180)
            )
        except ConditionTimeout as exc:
            raise AssertionError(f"{exc}\n{output.read_text(errors='replace')}") from exc
        assert alive(child)
        run.send_signal(signum)
        run.wait(timeout=60)
        eventually_sync(lambda: not alive(child), what=f"child {child} dies with the run")
    finally:
        if run.poll() is None:
            run.kill()
            run.wait()
        if child and alive(child):  # the sweep failed: do not leave it behind
            os.kill(child, signal.SIGKILL)


@pytest.mark.parametrize("sentinel", [False, True])
def test_the_run_finds_its_redis_servers(tmp_path: Path, sentinel: bool) -> None:
    # redis-server rewrites its process title over the memory /proc/PID/environ reads, which
    # would hide the run's mark from the watchdog: a killed run would leave it running.
    from carryover.bench.redis_server import RedisServer
    from tests.support.reaper import MARK_VARIABLE, marked_pids

    server = RedisServer(tmp_path / "redis", sentinel=sentinel)
    server.start()
    try:
        assert server.process is not None
        assert server.process.pid in marked_pids(os.environ[MARK_VARIABLE])
    finally:
        server.kill()
