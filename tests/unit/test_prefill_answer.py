"""P's answer as the router reads it: P's dict for D, and the ids P ran compared as JSON
with the checked ids, exactly as a decoded comparison would."""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from carryover.router.turn.prefill_answer import RanIds, read, same_ids

IDS = [151644, 872, 198, 0, 7, 151645]


def _answer(body: object) -> bytes:
    return msgspec.json.encode(body)


def test_the_ids_come_from_the_answer_else_from_choice_zero() -> None:
    top = read(_answer({"prompt_token_ids": IDS, "choices": [], "x": {"y": [1]}}))
    assert top.ran == RanIds(msgspec.json.encode(IDS))
    choices = [
        {"index": 1, "prompt_token_ids": [9]},
        {"index": 0, "text": "a", "prompt_token_ids": IDS},
    ]
    chosen = read(_answer({"choices": choices, "kv_transfer_params": {"a": 1}}))
    assert chosen.ran == RanIds(msgspec.json.encode(IDS))
    assert chosen.kv_transfer_params == {"a": 1}


@pytest.mark.parametrize("index", [0, 1])
def test_ids_cut_out_of_one_choice_go_back_into_it(index: int) -> None:
    answer = {
        "choices": [{"index": index, "text": TRICKY, "prompt_token_ids": IDS}],
        "kv_transfer_params": {"remote_block_ids": [[1, 2]], "note": TRICKY},
    }
    read_ = read(_answer(answer))
    assert read_.kv_transfer_params == answer["kv_transfer_params"]
    assert read_.ran == (RanIds(msgspec.json.encode(IDS)) if index == 0 else None)


# Text quoting the key, as a client's message or an engine's note could.
TRICKY = 'see "prompt_token_ids":[1, 2] here'


@pytest.mark.parametrize(
    "body",
    [{}, {"prompt_token_ids": None}, {"prompt_token_ids": "1,2"}, {"choices": None}],
)
def test_an_answer_without_an_array_of_ids_says_nothing(body: object) -> None:
    assert read(_answer(body)).ran is None


def test_spacing_does_not_matter_and_other_values_do() -> None:
    spaced = b'{"prompt_token_ids": [151644, 872,\n198, 0, 7, 151645]}'
    assert same_ids(read(spaced).ran or RanIds(b""), IDS)
    for other in ([*IDS, 1], IDS[:-1], [*IDS[:-1], 151646], []):
        assert not same_ids(RanIds(msgspec.json.encode(other)), IDS)
    assert not same_ids(RanIds(b'["151644"]'), [151644])
    assert not same_ids(RanIds(b"[1.0]"), [1])


@given(st.lists(st.integers(0, 2**31)), st.lists(st.integers(0, 2**31)))
def test_same_ids_agrees_with_comparing_decoded_lists(ran: list[int], ids: list[int]) -> None:
    assert same_ids(RanIds(msgspec.json.encode(ran)), ids) == (ran == ids)
    assert same_ids(RanIds(msgspec.json.encode(ids)), ids)
