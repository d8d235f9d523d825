"""The real tier's engines start with ``bench/real/engine_site`` on their path: in such a
process, NIXL's agent with its UCX backend (what vLLM's NixlConnector creates) leaves the CPU
alone while no transfer runs. Without it the agent's progress thread takes a whole core."""

from __future__ import annotations

import os
import subprocess

import pytest

from carryover.bench.real.env import ensure_env
from carryover.bench.real.launch import ENGINE_SITE

pytestmark = pytest.mark.real

#: An agent as vLLM's NixlConnector makes one, then a second of nothing: the process's CPU.
PROBE = """
import time
from nixl._api import nixl_agent, nixl_agent_config
agent = nixl_agent("probe", nixl_agent_config(capture_telemetry=True))
assert "UCX" in agent.backends, agent.backends
start = time.process_time()
time.sleep(1.0)  # the interval measured: nothing to wait for
print(time.process_time() - start)
"""


def test_nixl_s_progress_thread_waits_when_idle() -> None:
    python = ensure_env()
    env = {**os.environ, "PYTHONPATH": str(ENGINE_SITE)}
    run = subprocess.run(
        [str(python), "-c", PROBE], capture_output=True, text=True, env=env, timeout=120
    )
    assert run.returncode == 0, run.stderr[-2000:]
    idle_cpu = float(run.stdout.strip().splitlines()[-1])
    assert idle_cpu < 0.3, f"{idle_cpu:.2f} s of CPU in an idle second"
