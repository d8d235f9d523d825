"""The in-process renderer's check against P's ``/tokenize`` runs once P is known, whatever
the health probes' interval."""

from __future__ import annotations

from pathlib import Path

from tests.support.metrics import ascrape
from tests.support.stack import stack
from tests.support.waiting import eventually

AGREES = "carryover_render_check{model=0,state=agrees}"


async def test_a_long_health_interval_does_not_delay_rendering_in_process(
    tmp_path: Path,
) -> None:
    """The check needs P's model name, which the first health probe brings; before the fix
    a check that started before that answer waited a whole interval to try again, and every
    chat turn meanwhile was rendered by P (a second HTTP exchange per turn)."""
    async with stack(tmp_path, router_flags=("--health-interval", "60")) as s:
        url = s.routers[0].url
        await eventually(
            lambda: ascrape(s.client, url),
            lambda values: values.get(AGREES) == 1.0,
            what="the render check agrees",
            timeout=15,
        )
