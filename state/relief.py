"""Which held records pressure relief takes first: the largest holder's oldest (pure)."""

from __future__ import annotations

import heapq
from collections.abc import Hashable, Iterable
from typing import TypeVar

__all__ = ["largest_holders_first"]

T = TypeVar("T", bound=Hashable)


def largest_holders_first(entries: Iterable[tuple[float, T, str]], count: int) -> list[T]:
    """Up to ``count`` of ``(created_at, item, tenant)``: each pick is the oldest item of the
    tenant holding the most items still unpicked (ties: the older item). A tenant holding
    many handles on one decode instance gives its own oldest back before anyone else's, so
    no tenant can push another's history off D by holding more; among equals, oldest first."""
    by_tenant: dict[str, list[tuple[float, T]]] = {}
    for created_at, item, tenant in entries:
        by_tenant.setdefault(tenant, []).append((created_at, item))
    for held in by_tenant.values():
        held.sort(key=lambda pair: pair[0], reverse=True)  # oldest last: popped first
    heap = [(-len(held), held[-1][0], tenant) for tenant, held in by_tenant.items()]
    heapq.heapify(heap)
    chosen: list[T] = []
    while heap and len(chosen) < count:
        _, _, tenant = heapq.heappop(heap)
        held = by_tenant[tenant]
        chosen.append(held.pop()[1])
        if held:
            heapq.heappush(heap, (-len(held), held[-1][0], tenant))
    return chosen
