"""``carryover report`` against two routers under the simulator with known traffic: the numbers
it prints are what was sent (router/report), and each router's ``/metrics`` is one view of all
its workers, whichever worker answers the scrape."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest

from carryover.router.report.cli import main as report_main
from tests.support.metrics import ascrape
from tests.support.ports import free_port
from tests.support.sims import running, sim_config
from tests.support.stack import alternating_conversations, chat_turn, p_pulled, stack
from tests.support.waiting import eventually

TEXT = "Tell me, part {i}, how a lighthouse keeper spent the long winter nights on the rock. "


async def test_the_report_adds_up_two_routers_of_two_workers_turn_by_turn(
    tmp_path: Path, redis_server: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    flags = ("--redis", redis_server.url, "--held-interval", "0.2", "--workers", "2")
    # P keeps no prefix cache: what it did not compute, it pulled through a handle.
    p_sim = {"enable_prefix_caching": False}
    async with stack(
        tmp_path, routers=2, router_flags=flags, sim={"threshold": 16}, p_sim=p_sim
    ) as s:
        decode = urlsplit(s.decode[0].url).netloc
        # Three conversations of three streamed turns, each turn on the other router.
        await alternating_conversations(s, 3, 3, TEXT)
        # One non-streamed turn without a conversation: a path, but no streamed TTFT.
        plain = await chat_turn(s.client, s.router.url, [{"role": "user", "content": "Hi."}])
        assert plain.status == 200
        # And one refused before its model is known: counted by status, without a model.
        bad = await s.client.post(f"{s.router.url}/v1/chat/completions", json={"messages": 7})
        assert bad.status_code == 400

        # Every scrape, whichever worker takes it, reads every turn of both workers once.
        for _ in range(12):
            views = [await ascrape(s.client, r.url) for r in s.routers]
            assert sum(v["carryover_turns_total:sum"] for v in views) == 10
            assert sum(v["carryover_ttft_seconds_count:sum"] for v in views) == 9
            ok = "carryover_responses_total{error=,model=sim-qwen3,status=200}"
            assert sum(v.get(ok, 0) for v in views) == 10
            refused = "carryover_responses_total{error=BadRequestError,model=,status=400}"
            assert views[0][refused] == 1
            # Six later turns claimed a handle, ten left one at D: the books of both workers.
            assert sum(v["carryover_handles_held_total{origin=claimed}"] for v in views) == 6
            answered = "carryover_answer_seconds_count{model=sim-qwen3,stream=false,turn=}"
            assert views[0][answered] == 1  # the turn without a conversation has no turn

        async def fleet_view() -> float:
            values = await ascrape(s.client, s.routers[1].url)
            return values.get(f"carryover_decode_handles{{server={decode}}}", -1.0)

        await eventually(fleet_view, lambda held: held == 3, what="the held handles are read")
        urls = [arg for r in s.routers for arg in ("--metrics", r.url)]
        await asyncio.to_thread(report_main, [*urls, "--since", "0", "--json"])
        report = json.loads(capsys.readouterr().out)

        assert report["routers"] == 2 and report["window_s"] is None
        by_turn = {row["turns"]: row for row in report["ttft"]}
        assert {k: v["count"] for k, v in by_turn.items()} == {"1": 3, "2": 3, "3-5": 3}
        assert all(0 < row["p50_ms"] <= row["p99_ms"] for row in by_turn.values())
        paths = report["turns_by_path"]
        assert sum(paths.values()) == 10
        assert paths["cold-miss"] == 3  # three first turns
        assert paths["no-conversation"] == 1
        # Every turn of a conversation had a P leg, streamed or not; the report has them all.
        ready = {row["turns"]: row["count"] for row in report["prompt_ready"]}
        assert ready == {"1": 3, "2": 3, "3-5": 3}
        assert report["responses"] == {"200": 10, "400": 1}
        assert paths.get("reuse", 0) + paths.get("partial", 0) == 6
        # The reused tokens are what P pulled, by P's own counter, and what both routers'
        # counters add up to.
        metrics = [await ascrape(s.client, r.url) for r in s.routers]
        reused = sum(
            m["carryover_prompt_tokens_total{kind=reused,model=sim-qwen3}"] for m in metrics
        )
        assert report["prompt_tokens_reused"] == await p_pulled(s) == reused > 0
        assert report["reused_share"] > 0
        # Every router reads the same store: three handles, counted once.
        assert report["decode_held"][decode]["handles"] == 3

        image = tmp_path / "report.png"
        await asyncio.to_thread(report_main, [*urls, "--since", "0", "--png", str(image)])
        text = capsys.readouterr().out
        assert image.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert "| 3-5 | 3 |" in text and f"| {decode} | 3 |" in text


async def test_watch_prints_one_report_per_window_of_what_was_sent_in_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    async with stack(tmp_path, sim={"threshold": 16}) as s:
        loop = asyncio.get_running_loop()
        per_window = iter([2, 3])  # turns sent while each window is open
        waited: list[float] = []

        async def send(turns: int) -> None:
            messages: list[dict[str, Any]] = []
            for turn in range(turns):
                messages.append({"role": "user", "content": TEXT.format(i=turn)})
                got = await chat_turn(s.client, s.router.url, messages, stream=True)
                assert got.status == 200, got.raw
                messages.append({"role": "assistant", "content": got.content})

        def window(seconds: float) -> None:  # the report's clock: a window is the traffic
            waited.append(seconds)
            asyncio.run_coroutine_threadsafe(send(next(per_window)), loop).result()

        args = ["--metrics", s.router.url, "--since", "7s", "--watch", "--count", "2", "--json"]
        await asyncio.to_thread(report_main, args, sleep=window)
        lines = capsys.readouterr().out.splitlines()
        reports = [json.loads(line) for line in lines]
        assert waited == [7.0, 7.0]
        assert [sum(r["turns_by_path"].values()) for r in reports] == [2, 3]
        assert [r["window_s"] for r in reports] == [7.0, 7.0]


@pytest.mark.parametrize(
    ("args", "complaint"),
    [
        (["--metrics", "http://x", "--since", "0", "--watch"], "--watch needs a window"),
        (["--metrics", "http://x", "--count", "2"], "--count N goes with --watch"),
        (["--metrics", "http://x", "--match", 'job="a"'], "--match goes with --prometheus"),
        (["--metrics", "http://x", "--prometheus", "http://y"], "not allowed with"),
    ],
)
def test_report_options_that_do_not_go_together_are_refused(
    args: list[str], complaint: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as refused:
        report_main(args)
    assert refused.value.code == 2
    assert complaint in capsys.readouterr().err


async def test_report_says_what_it_waits_for_and_names_what_it_cannot_read(
    capsys: pytest.CaptureFixture[str],
) -> None:
    async with running(sim_config(None)) as engine:
        waited: list[float] = []
        args = ["--metrics", engine.url, "--since", "1d", "--json"]
        await asyncio.to_thread(report_main, args, sleep=waited.append)
        said = capsys.readouterr().err
        assert waited == [86400.0] and "the next 1d" in said
        # An engine is no router: said, with its URL.
        assert f"{engine.url} exposes no carryover metrics" in said
    gone = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(SystemExit) as failed:
        await asyncio.to_thread(report_main, ["--metrics", gone, "--since", "0"])
    assert failed.value.code == 1
    assert f"cannot read {gone}" in capsys.readouterr().err
