"""The client leaving at every loop step of a turn, under random faults: each schedule runs
once per step at which one of its turns can be interrupted."""

from __future__ import annotations

from tests.explore.budget import EXPLORED_SWEEPS
from tests.explore.exploring import explore, report, seeds
from tests.explore.schedules import Run, Schedule, sweep


async def _every_step(schedule: Schedule) -> list[Run]:
    return await sweep(schedule, schedule.seed % len(schedule.turns))


async def test_a_client_leaving_at_any_step_keeps_every_invariant() -> None:
    ran, found = await explore(seeds("leaving", EXPLORED_SWEEPS), _every_step)
    print(report("client leaving at every step", ran, found))
    assert ran > EXPLORED_SWEEPS
    assert not found, report("client leaving at every step", ran, found)
