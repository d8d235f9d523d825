"""The turn-cost rule (router/turn/costs.py): which source of a later turn's history is
cheapest, in computed tokens."""

from __future__ import annotations

import pytest

from carryover.router.config import ConfigError, TurnCosts
from carryover.router.turn.costs import decode_local_pays, prefill_leg_cost, pull_pays

COSTS = TurnCosts(prefill_leg_tokens=128, pull_tokens=32, pulled_token=0.05, decode_stall=1.0)


@pytest.mark.parametrize(
    ("prefill_holds", "handle", "pays"),
    [
        (0, 2000, True),  # P holds nothing: the whole history is worth pulling
        (1900, 2000, True),  # 100 tokens over P's hit: 37 to pull against 100 to compute
        (1970, 2000, False),  # 30 tokens over P's hit: a pull's fixed part alone is more
        (2000, 2000, False),  # P holds it all: nothing to pull
        (2100, 2000, False),  # P holds more than the handle
    ],
)
def test_a_pull_pays_only_past_its_fixed_cost(prefill_holds: int, handle: int, pays: bool) -> None:
    assert pull_pays(prefill_holds, handle, COSTS) is pays


def test_a_p_leg_costs_its_fixed_part_what_p_computes_and_the_pull_when_it_pays() -> None:
    # 3,000-token prompt, handle of 2,000, P holds 1,000: pull 1,000 (32 + 50), compute 1,000.
    assert prefill_leg_cost(3000, 1000, 2000, COSTS) == pytest.approx(128 + 82 + 1000)
    # P holds 1,990 of the handle's 2,000: no pull, P computes the last 1,010.
    assert prefill_leg_cost(3000, 1990, 2000, COSTS) == pytest.approx(128 + 1010)


def test_decode_local_wins_on_an_idle_decoder_and_loses_on_a_busy_one() -> None:
    # D holds 2,000 of 2,150 tokens; P holds 1,400, would pull 600 and compute 150.
    args = (2150, 2000)
    # The P leg: 128 + (32 + 0.05 * 600) + 150 = 340.
    assert decode_local_pays(*args, 0, 1400, 2000, COSTS)  # 150
    assert decode_local_pays(*args, 1, 1400, 2000, COSTS)  # 300: one stream stalls too
    assert decode_local_pays(*args, 2, 1400, 2000, COSTS) is False  # 450
    free_stalls = TurnCosts(decode_stall=0.0)
    assert decode_local_pays(*args, 50, 1400, 2000, free_stalls)


def test_negative_costs_are_refused_in_one_line() -> None:
    with pytest.raises(ConfigError, match="pull_tokens"):
        TurnCosts(pull_tokens=-1)
    with pytest.raises(ConfigError, match="decode_stall"):
        TurnCosts(decode_stall=-0.5)
