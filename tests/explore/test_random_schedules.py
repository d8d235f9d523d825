"""The turn under random fault schedules: every run keeps the invariants of
``schedules.violations`` (one fate per handle, no released handle stored or read, no handle
across model, tenant or salt, answers equal to the cold answer or an error)."""

from __future__ import annotations

from tests.explore.budget import EXPLORED_SCHEDULES
from tests.explore.exploring import explore, report, seeds
from tests.explore.schedules import Run, Schedule, run


async def _once(schedule: Schedule) -> list[Run]:
    return [await run(schedule)]


async def test_random_fault_schedules_keep_every_invariant() -> None:
    ran, found = await explore(seeds("random", EXPLORED_SCHEDULES), _once)
    print(report("random schedules", ran, found))
    assert ran == EXPLORED_SCHEDULES
    assert not found, report("random schedules", ran, found)
