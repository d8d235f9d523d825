"""How many held handles a full decode instance gives back."""

from __future__ import annotations

import pytest

from carryover.router.fleet.pressure import share_to_release


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
