"""The fate table's own rules, read off the table (router/handles/fates.py), and its page."""

from __future__ import annotations

from pathlib import Path

from carryover.router.handles.fates import FATES, Event, Fate, Stage, decide, table

DOCS = Path(__file__).parents[3] / "docs" / "handles.md"


def test_the_page_shows_the_table_as_it_is() -> None:
    assert table() in DOCS.read_text(), "docs/handles.md: paste fates.table() in"


def test_a_handle_p_may_have_read_is_released_only_on_ps_own_proof() -> None:
    released = {e for (s, e), d in FATES.items() if s is Stage.SENT and d.fate is Fate.RELEASED}
    assert released == {Event.P_REFUSED, Event.P_FREED}
    assert decide(Stage.SENT, Event.P_FREED)[0].carried  # P already freed it: nothing more sent


def test_a_handle_in_a_store_write_is_the_writes_to_settle() -> None:
    for event in (Event.CLIENT_GONE, Event.TURN_FAILED):
        assert decide(Stage.WRITING, event)[0].fate is None
    assert decide(Stage.WRITING, Event.STORE_UNKNOWN)[0].fate is Fate.LEFT_TO_EXPIRE


def test_every_stage_a_turn_holds_has_a_fate_for_a_client_leaving_and_for_a_failure() -> None:
    for stage in (Stage.CLAIMED, Stage.SENT, Stage.DECODE_LOCAL, Stage.DECODED, Stage.WRITING):
        assert (stage, Event.CLIENT_GONE) in FATES and (stage, Event.TURN_FAILED) in FATES


def test_a_pair_the_table_lacks_is_never_a_release() -> None:
    decision, planned = decide(Stage.TAKEN, Event.P_READ)
    assert not planned and decision.fate is Fate.LEFT_TO_EXPIRE


async def test_a_second_fate_is_refused_and_its_release_never_sent() -> None:
    from carryover.router.handles.ledger import HandleLedger, HeldHandle, Origin
    from carryover.router.metrics import RouterMetrics

    sent: list[HeldHandle] = []

    async def release(held: HeldHandle) -> bool:
        sent.append(held)
        return True

    metrics = RouterMetrics()
    ledger = HandleLedger(metrics, release)
    held = ledger.hold(Origin.CLAIMED, {"remote_request_id": "d-1"})
    assert await ledger.record(held, Event.CLIENT_GONE) is True  # type: ignore[misc]
    assert ledger.record(held, Event.UNCHECKED) is None
    assert sent == [held] and ledger.open == 0
    assert metrics.ledger_errors._value.get() == 1
