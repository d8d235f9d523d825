"""How the tier's engines run on this machine's two cores."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from carryover.bench.real.launch import VllmPair
from carryover.bench.real.process import worker_pids

pytestmark = [pytest.mark.real, pytest.mark.engines("pd")]


def test_each_engine_runs_its_model_on_a_core_of_its_own(vllm_pair: VllmPair) -> None:
    # vLLM's NIXL connector moves the worker's main thread to the last core: P and D would
    # then compute on one core while the other idles (bench/real/process.py bind_workers).
    cores = {}
    for instance in (vllm_pair.prefill, vllm_pair.decode):
        assert instance is not None and instance.popen is not None
        workers = worker_pids(instance.popen)
        assert workers, f"no worker process under vLLM {instance.role}"
        for pid in workers:
            bound = {
                frozenset(os.sched_getaffinity(int(task.name)))
                for task in Path(f"/proc/{pid}/task").iterdir()
            }
            assert bound == {frozenset({instance.core})}, (instance.role, bound)
        cores[instance.role] = instance.core
    assert cores["prefill"] != cores["decode"]
