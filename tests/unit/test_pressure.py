"""How many held handles a full decode instance gives back, and when it takes no new ones."""

from __future__ import annotations

import pytest

from carryover.router.fleet.pressure import keeps_new_pins, share_to_release


@pytest.mark.parametrize(
    ("usage", "held", "expected"),
    [
        (0.89, 100, 0),  # below the mark: nothing
        (0.9, 100, 17),  # at the mark: the share above low water, (0.9 - 0.75) / 0.9
        (1.0, 100, 25),
        (1.0, 3, 1),  # rounded up
        (0.95, 1, 1),  # at least one
        (1.0, 0, 0),  # nothing stored for it (pins of another router, or of expired records)
    ],
)
def test_share(usage: float, held: int, expected: int) -> None:
    assert share_to_release(usage, held, high_water=0.9, low_water=0.75) == expected


def test_never_more_than_held() -> None:
    assert share_to_release(1.0, 10, high_water=0.5, low_water=0.01) == 10


@pytest.mark.parametrize(("usage", "kept"), [(0.0, True), (0.79, True), (0.8, False), (1.0, False)])
def test_a_decode_at_the_mark_keeps_no_new_pins(usage: float, kept: bool) -> None:
    assert keeps_new_pins(usage, limit=0.8) is kept


@pytest.mark.parametrize(
    ("usage", "pinned", "kept"),
    [
        (0.5, 50_000, True),  # half of 100k tokens left: room for another such turn
        (0.5, 50_001, False),
        (0.1, 95_000, False),  # far below the limit, but the turn is most of D
        (0.79, 1_000, True),
    ],
)
def test_a_pin_is_kept_only_with_room_left_for_another_turn_of_its_size(
    usage: float, pinned: int, kept: bool
) -> None:
    assert keeps_new_pins(usage, limit=0.8, pinned_tokens=pinned, capacity=100_000) is kept


def test_an_unknown_capacity_leaves_the_limit_alone() -> None:
    assert keeps_new_pins(0.5, limit=0.8, pinned_tokens=10**9, capacity=0)


def test_a_mark_above_one_keeps_every_pin() -> None:
    assert keeps_new_pins(1.0, limit=1.01)
