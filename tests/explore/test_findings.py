"""The schedules of the audit's findings, each run under the exploration's invariants: every
one of them broke an invariant before the turn's fates were decided in one table."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from carryover.router.config.load import load_config
from carryover.router.http.app import create_app
from carryover.state import FENCE_SLACK, MemoryStore
from tests.explore.engines import MODEL, Engines, Fault, answer_of, render
from tests.explore.schedules import (
    KEYS,
    Run,
    Schedule,
    TurnPlan,
    run,
    sweep,
    until,
    violations,
)


@pytest.fixture(autouse=True)
def _quiet() -> Iterator[None]:
    logging.disable(logging.WARNING)  # the injected failures are logged, each
    yield
    logging.disable(logging.NOTSET)


def turn(**changes: object) -> TurnPlan:
    plan = TurnPlan(
        stream=False,
        tenant_key="k1",
        salt=None,
        model=MODEL,
        odd_part=None,
        leave_at=None,
        again_at=None,
    )
    return TurnPlan(**{**plan.__dict__, **changes})  # type: ignore[arg-type]


def schedule(
    *turns: TurnPlan, names_known: bool = True, when_prefill_down: str = "decode-alone"
) -> Schedule:
    return Schedule(0, 1, 1, when_prefill_down, names_known, turns)


def broken(runs: list[Run]) -> list[str]:
    return [v for result in runs for v in violations(result)]


async def test_a_record_put_back_never_keeps_a_handle_its_leaving_client_released() -> None:
    """No P, ``when_prefill_down = "fail"``: the claimed record is put back while the client
    may leave at any step; its handle is never both released and stored."""
    plan = schedule(turn(), turn(p_faults=(Fault.REFUSE,)), turn(), when_prefill_down="fail")
    runs = await sweep(plan, 1)
    assert len(runs) > 5
    assert broken(runs) == []


async def test_turns_of_a_model_whose_served_name_is_unknown_share_no_kv() -> None:
    plan = schedule(turn(), turn(model="lora-a"), turn(), turn(model="lora-a"), names_known=False)
    result = await run(plan)
    assert violations(result) == []
    assert {reply.path for reply in result.replies} == {"cold-error"}


@pytest.mark.parametrize(
    "part",
    [
        {"type": "text", "text": "look", "video_embeds": "AAAA"},
        {"input_image": "http://x/i.png"},
        {"type": "text", "text": "see", "prompt_embeds": "AAAA"},
        {"type": "input_video", "video": "v"},  # a type no vLLM here knows
    ],
)
async def test_content_parts_the_router_does_not_know_are_never_checked_as_text(
    part: dict[str, object],
) -> None:
    result = await run(schedule(turn(), turn(odd_part=part), turn()))
    assert violations(result) == []
    assert [reply.path for reply in result.replies][1:] == ["cold-unchecked"] * 2


async def test_a_client_salt_is_part_of_the_conversation_key() -> None:
    result = await run(schedule(turn(salt="A"), turn(salt="B"), turn(salt="A"), turn(salt="B")))
    assert violations(result) == []
    assert [reply.path for reply in result.replies] == ["cold-miss", "cold-miss", "reuse", "reuse"]


async def test_a_client_leaving_between_ds_last_chunk_and_done_leaves_no_handle_unheld() -> None:
    runs = await sweep(schedule(turn(), turn(stream=True), turn()), 1)
    assert len(runs) > 5
    assert broken(runs) == []


@pytest.mark.parametrize("status", [408, 429])
async def test_a_proxys_timeout_or_rate_limit_never_releases_a_handle_p_may_have_read(
    status: int,
) -> None:
    result = await run(schedule(turn(), turn(p_faults=(status,)), turn()))
    assert violations(result) == []
    assert [reply.status for reply in result.replies] == [200, status, 200]


async def test_a_replica_whose_clock_runs_ahead_fences_no_turn_that_began_after_its_delete() -> (
    None
):
    """Two replicas sharing one store, one's clock a minute ahead: its DELETE fences the
    turns in flight, not the conversation's next turns on the other replica."""
    engines = Engines(["p0:8000"], ["d0:8000"])
    moved = [0.0]  # the store's own clock: the real one, moved on past a DELETE's slack
    store = MemoryStore(clock=lambda: time.time() + moved[0])
    args = ["--prefill", "http://p0:8000", "--decode", "http://d0:8000"]
    args += ["--render-backend", "engine", "--expose-path-header", "--health-interval", "3600"]
    config = load_config(args, environ={"CARRYOVER_API_KEYS": json.dumps(KEYS)})
    ahead = create_app(config, transport=engines, store=store, clock=lambda: time.time() + 60)
    behind = create_app(config, transport=engines, store=store, clock=time.time)
    auth = {"Authorization": "Bearer k1"}
    async with (
        ahead.lifespan(),
        behind.lifespan(),
        httpx.AsyncClient(transport=httpx.ASGITransport(ahead), base_url="http://a") as a,
        httpx.AsyncClient(transport=httpx.ASGITransport(behind), base_url="http://b") as b,
    ):
        for app in (ahead, behind):
            services = app.state.services
            await until(lambda s=services: all(r.name for r in s.models), "the model's name")
        history: list[dict[str, Any]] = []
        paths = []
        for index in range(3):
            messages = [
                *history,
                {"role": "user", "content": f"turn {index}: rivers and stones " * 8},
            ]
            body = {"model": MODEL, "messages": messages, "conversation_id": "c1", "max_tokens": 16}
            r = await b.post("/v1/chat/completions", json=body, headers=auth)
            assert r.status_code == 200, r.text
            paths.append(r.headers["x-carryover-path"])
            history = [*messages, {"role": "assistant", "content": answer_of(render(messages))}]
            if index == 0:
                deleted = await a.delete("/v1/conversations/c1", headers=auth)
                assert deleted.status_code == 200, deleted.text
                history = []
                # the next turn begins after the DELETE and its slack on the store's clock
                moved[0] = FENCE_SLACK + 1.0
        await ahead.state.services.runner.drain_background()
        await behind.state.services.runner.drain_background()
    assert paths == ["cold-miss", "cold-miss", "reuse"]
    assert engines.violations == []
