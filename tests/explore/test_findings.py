"""The schedules of the audit's findings, each run under the exploration's invariants: every
one of them broke an invariant before the turn's fates were decided in one table."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest

from tests.explore.engines import MODEL, Fault
from tests.explore.schedules import Run, Schedule, TurnPlan, run, sweep, violations


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
