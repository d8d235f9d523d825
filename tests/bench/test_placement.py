"""Where a benchmark's processes run: the routers under test on CPUs of their own, the rest
(engines, load generator) on the others, the engines at a lower priority."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from carryover.bench.placement import Placement, parse_cpus

ALL = frozenset({0, 1, 2, 3})


def test_cpu_lists_are_taskset_s_and_must_leave_cpus_for_the_rest() -> None:
    assert parse_cpus("1", ALL) == {1}
    assert parse_cpus("0,2-3", ALL) == {0, 2, 3}
    with pytest.raises(ValueError, match="not a CPU list"):
        parse_cpus("one", ALL)
    with pytest.raises(ValueError, match="not all usable"):
        parse_cpus("4", ALL)
    with pytest.raises(ValueError, match="leave none"):
        parse_cpus("0-3", ALL)


def test_unplaced_commands_run_as_given_and_engines_are_niced() -> None:
    assert Placement().router_command(["carryover"]) == ("carryover",)
    assert Placement().engine_command(["sim"]) == ("sim",)
    assert Placement(engine_nice=10).engine_command(["sim"]) == ("nice", "-n", "10", "sim")
    assert Placement().rest_cpus == frozenset()


def test_routers_and_the_rest_run_on_cpus_apart() -> None:
    mine = sorted(os.sched_getaffinity(0))
    assert len(mine) >= 2, "the reference machine has two cores; placement needs two"
    placement = Placement(engine_nice=5, router_cpus=frozenset({mine[-1]}))
    rest = set(mine[:-1])
    probe = [sys.executable, "-c", "import os; print(sorted(os.sched_getaffinity(0)))"]
    router = subprocess.run(placement.router_command(probe), capture_output=True, text=True)
    engine = subprocess.run(placement.engine_command(probe), capture_output=True, text=True)
    assert router.stdout.strip() == str([mine[-1]])
    assert engine.stdout.strip() == str(sorted(rest))
    with placement.load_generator():
        assert os.sched_getaffinity(0) == rest
    assert sorted(os.sched_getaffinity(0)) == mine
    assert "routers on CPU" in placement.describe()
