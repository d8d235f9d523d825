"""A benchmark ended with SIGTERM (a CI timeout, ``kill``) stops the engines it started."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from carryover.bench import procs
from carryover.bench.cli import _unwind
from carryover.bench.proctree import tree
from tests.support.waiting import eventually_sync


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


def test_sigterm_stops_the_simulated_engines_a_benchmark_started(tmp_path: Path) -> None:
    endless = ["bench", "sim", "--requests", "100000000", "--concurrency", "1"]
    bench = subprocess.Popen(
        [sys.executable, "-m", "carryover", *endless, "--out", str(tmp_path)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env={**os.environ, "TMPDIR": str(tmp_path)},  # where its logs' folder goes
    )
    engines: list[int] = []
    try:
        # The engines run in sessions of their own: only the benchmark's cleanup stops them.
        engines = eventually_sync(
            lambda: tree(bench.pid)[1:], what="the benchmark started its engine"
        )
        bench.send_signal(signal.SIGTERM)
        assert bench.wait(timeout=30) == 128 + signal.SIGTERM
        eventually_sync(
            lambda: [pid for pid in engines if _alive(pid)],
            lambda alive: not alive,
            what="the engines stopped",
            timeout=20,
        )
        # A run that did not end cleanly keeps its processes' logs.
        assert [log.name for log in tmp_path.glob("carryover-*/*.log")] == ["engine.log"]
    finally:
        if bench.poll() is None:
            bench.kill()
        for pid in engines:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


_IDLE = "import signal; signal.pause()"  # until the topology's stop signals it


def test_sigterm_while_a_child_starts_still_stops_that_child(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """SIGTERM landing inside ``Popen`` after the fork (the benchmark's handler raises there)
    must not leave that child, in its own session, outside the topology's cleanup."""
    started: list[subprocess.Popen[bytes]] = []
    real_popen = subprocess.Popen

    def popen_then_sigterm(*args: Any, **kwargs: Any) -> subprocess.Popen[bytes]:
        started.append(real_popen(*args, **kwargs))
        signal.raise_signal(signal.SIGTERM)  # its handler runs before Popen would return
        return started[-1]

    previous = signal.signal(signal.SIGTERM, _unwind)
    monkeypatch.setattr(procs.subprocess, "Popen", popen_then_sigterm)
    try:
        with pytest.raises(SystemExit), procs.topology(log_dir=tmp_path) as topo:
            topo._spawn("idle", ["--port", "1"], command=(sys.executable, "-c", _IDLE))
        assert [child.poll() is not None for child in started] == [True]
    finally:
        signal.signal(signal.SIGTERM, previous)
        for child in started:
            if child.poll() is None:
                child.kill()
                child.wait()


def test_logs_are_kept_where_asked_or_after_a_failure_and_named(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with procs.topology() as topo:
        topo._spawn("idle", ["--port", "1"], command=(sys.executable, "-c", _IDLE))
        clean = topo.log_dir
        assert (clean / "idle.log").exists()
    assert not clean.exists()  # a clean run leaves nothing behind
    with pytest.raises(RuntimeError), procs.topology() as topo:
        failed = topo.log_dir
        topo._spawn("idle", ["--port", "1"], command=(sys.executable, "-c", _IDLE))
        raise RuntimeError("an arm failed")
    try:
        assert (failed / "idle.log").exists() and str(failed) in capsys.readouterr().err
    finally:
        shutil.rmtree(failed)
    with procs.topology(log_dir=tmp_path / "logs") as topo:
        topo._spawn("idle", ["--port", "1"], command=(sys.executable, "-c", _IDLE))
    assert (tmp_path / "logs" / "idle.log").exists()
