"""A killed test run finds vLLM's processes too (tests/support/reaper.py): vLLM titles its
engine core, workers and API servers with py-setproctitle, which by default writes the title
over the memory /proc/PID/environ shows, and with it the run's mark."""

from __future__ import annotations

import os
import subprocess

import pytest

from carryover.bench.real.env import python
from tests.support.reaper import MARK_VARIABLE, marked_pids

pytestmark = pytest.mark.real

TITLED = """
import sys, setproctitle
setproctitle.setproctitle("VLLM::EngineCore_DP0 " + "x" * 200)  # vLLM's call, a long title
print("titled", flush=True)
sys.stdin.read()  # until the test closes stdin
"""


def test_a_process_titled_as_vllm_titles_its_own_keeps_the_runs_mark() -> None:
    child = subprocess.Popen(
        [str(python()), "-c", TITLED],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
    )
    try:
        assert child.stdout is not None and child.stdout.readline() == b"titled\n"
        assert child.pid in marked_pids(os.environ[MARK_VARIABLE])
    finally:
        child.communicate(timeout=30)
