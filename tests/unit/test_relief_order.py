"""The order pressure relief takes held records in (state/relief.py)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from carryover.state.relief import largest_holders_first


def test_the_largest_holder_gives_back_first_then_the_oldest_among_equals() -> None:
    entries = [(1.0, "a1", "a"), (2.0, "b1", "b"), (3.0, "b2", "b"), (4.0, "b3", "b")]
    assert largest_holders_first(entries, 2) == ["b1", "b2"]
    assert largest_holders_first(entries, 3) == ["b1", "b2", "a1"]
    assert largest_holders_first(entries, 10) == ["b1", "b2", "a1", "b3"]


@given(
    st.lists(st.tuples(st.floats(0, 100), st.sampled_from("abc")), max_size=40),
    st.integers(0, 50),
)
def test_no_tenant_ends_with_fewer_than_another_has_more_than_one_above(
    held: list[tuple[float, str]], count: int
) -> None:
    """What is left is as even as taking ``count`` could make it: a tenant was only ever
    taken from while it held the most."""
    entries = [(created, i, tenant) for i, (created, tenant) in enumerate(held)]
    chosen = set(largest_holders_first(entries, count))
    assert len(chosen) == min(count, len(entries))
    left: dict[str, int] = {}
    taken: dict[str, int] = {}
    for _, i, tenant in entries:
        bucket = taken if i in chosen else left
        bucket[tenant] = bucket.get(tenant, 0) + 1
    for tenant, n in taken.items():
        if n:
            # It was taken from while it held the most: it ends at most one below any other.
            assert all(left.get(tenant, 0) + 1 >= other for other in left.values())
