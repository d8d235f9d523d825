"""A real Prometheus scraping two routers under the simulator: ``carryover report
--prometheus`` prints what the routers' own ``/metrics`` give, a window holds exactly the
turns sent in it, and every query of the Grafana dashboard runs and finds the traffic."""

from __future__ import annotations

import asyncio
import json
import math
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest

from carryover.router.report.cli import main as report_main
from carryover.router.report.prometheus import window
from carryover.router.report.summary import summarize
from tests.support.prometheus import Prometheus, prometheus
from tests.support.stack import alternating_conversations, stack

TEXT = "Tell me, part {i}, how the ferry crossed the strait in the winter storms. "
DASHBOARD = Path(__file__).parents[2] / "deploy" / "grafana" / "carryover.json"


async def report(args: list[str], capsys: pytest.CaptureFixture[str]) -> dict[str, Any]:
    await asyncio.to_thread(report_main, [*args, "--json"])
    found: dict[str, Any] = json.loads(capsys.readouterr().out)
    for held in found["decode_held"].values():
        held.pop("oldest_age_s")  # read at different moments by the two sources
    return found


async def test_prometheus_gives_the_routers_report_and_exact_windows(
    tmp_path: Path, redis_server: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    flags = ("--redis", redis_server.url, "--held-interval", "0.2")
    async with (
        stack(tmp_path, routers=2, router_flags=flags, sim={"threshold": 16}) as s,
        prometheus(tmp_path / "prometheus", [r.url for r in s.routers], s.client) as prom,
    ):
        sent = await alternating_conversations(s, 2, 3, TEXT)
        await prom.scraped("sum(carryover_turns_total)", sent, what="the first turns scraped")
        await prom.scraped("max(carryover_decode_handles)", 2, what="the held handles scraped")

        direct = await report(
            [a for r in s.routers for a in ("--metrics", r.url)] + ["--since", "0"], capsys
        )
        through = await report(["--prometheus", prom.url, "--since", "0"], capsys)
        assert through == direct
        assert through["routers"] == 2 and sum(through["turns_by_path"].values()) == sent

        # A window that starts after those turns were scraped holds the later turns alone,
        # whole (a path seen for the first time in it too).
        middle = time.time()
        later = await alternating_conversations(s, 1, 4, TEXT)
        await prom.scraped(
            "sum(carryover_turns_total)", sent + later, what="the later turns scraped"
        )
        # What the window's TTFT rows read, scraped too (every turn here is streamed).
        await prom.scraped(
            "sum(carryover_ttft_seconds_count)", sent + later, what="the later TTFTs scraped"
        )
        end = time.time()
        found = await asyncio.to_thread(window, prom.url, end - middle, now=end)
        counted = summarize(found.samples, window_s=end - middle, routers=found.routers)
        assert sum(counted.turns_by_path.values()) == later
        assert {row.turns: row.count for row in counted.ttft} == {"1": 1, "2": 1, "3-5": 2}
        assert counted.prompt_tokens_reused > 0

        # The fleet's series narrowed by label matchers; a bad matcher is a clear error.
        unnarrowed = await report(["--prometheus", prom.url, "--since", "0"], capsys)
        narrowed = await report(
            ["--prometheus", prom.url, "--since", "0", "--match", 'job="carryover"'], capsys
        )
        assert narrowed == unnarrowed and sum(narrowed["turns_by_path"].values()) == sent + later
        elsewhere = await report(
            ["--prometheus", prom.url, "--since", "0", "--match", 'job="other"'], capsys
        )
        assert elsewhere["routers"] == 0 and not elsewhere["turns_by_path"]
        with pytest.raises(SystemExit) as refused:
            await asyncio.to_thread(
                report_main, ["--prometheus", prom.url, "--match", "job=", "--since", "0"]
            )
        assert refused.value.code == 1
        assert f"Prometheus at {prom.url} refused the query" in capsys.readouterr().err


def dashboard_queries() -> list[tuple[str, str]]:
    dashboard = json.loads(DASHBOARD.read_text())
    return [
        (panel["title"], target["expr"].replace("$__rate_interval", "1m"))
        for panel in dashboard["panels"]
        if panel["type"] != "row"
        for target in panel["targets"]
    ]


async def series(prom: Prometheus, expr: str) -> list[dict[str, Any]]:
    return [item for item in await prom.query(expr) if not math.isnan(float(item["value"][1]))]


async def test_every_dashboard_query_runs_and_the_core_panels_show_the_traffic(
    tmp_path: Path, redis_server: Any
) -> None:
    flags = ("--redis", redis_server.url, "--held-interval", "0.2")
    async with (
        stack(tmp_path, routers=2, router_flags=flags, sim={"threshold": 16}) as s,
        prometheus(tmp_path / "prometheus", [r.url for r in s.routers], s.client) as prom,
    ):
        decode = urlsplit(s.decode[0].url).netloc
        # Rates need a series' earlier value: one conversation creates them, scraped, then
        # the traffic the panels are read for.
        first = await alternating_conversations(s, 1, 3, TEXT)
        await prom.scraped("sum(carryover_turns_total)", first, what="the first turns scraped")
        sent = first + await alternating_conversations(s, 1, 3, TEXT)
        await prom.scraped("sum(carryover_turns_total)", sent, what="the turns scraped")
        await prom.scraped("max(carryover_decode_handles)", 2, what="the held handles scraped")

        results = {}
        for title, expr in dashboard_queries():
            results[(title, expr)] = await series(prom, expr)  # a refused query fails here
        by_title: dict[str, list[dict[str, Any]]] = {}
        for (title, _), found in results.items():
            by_title.setdefault(title, []).extend(found)

        turns = {
            item["metric"].get("turn") for item in by_title["Time to first token by turn, p50"]
        }
        assert {"1", "2", "3-5"} <= turns
        # Held handles are keyed by the decode engine, not by the router that was scraped.
        held = by_title["Handles held per decode instance"]
        assert [(item["metric"], float(item["value"][1])) for item in held] == [
            ({"server": decode}, 2.0)
        ]
        assert by_title["Turns by path"], "no turn rate"
