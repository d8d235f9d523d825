"""A router reports its event loop's lag from its start: the histogram's count grows while it
serves (ten timers a second), whether or not a turn runs."""

from __future__ import annotations

from pathlib import Path

from tests.support.metrics import ascrape
from tests.support.stack import stack
from tests.support.waiting import eventually

LAG = "carryover_event_loop_lag_seconds_count"


async def test_the_router_reports_its_loop_lag(tmp_path: Path) -> None:
    async with stack(tmp_path) as s:
        first = await eventually(
            lambda: ascrape(s.client, s.router.url),
            lambda m: m.get(LAG, 0) >= 1,
            what="a first loop-lag sample",
        )
        await eventually(
            lambda: ascrape(s.client, s.router.url),
            lambda m: m.get(LAG, 0) >= first[LAG] + 2,
            what="more samples as the router runs",
        )
