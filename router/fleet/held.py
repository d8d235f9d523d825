"""Reports the handles each decode instance holds for stored records, and their age.

Read from the store, so every replica reports the same numbers for the whole fleet.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from carryover.router.metrics import RouterMetrics
from carryover.state import Store, StoreUnavailable

__all__ = ["report_held", "report_held_forever"]

log = logging.getLogger("carryover.held")


async def report_held(store: Store, decode_names: list[str], metrics: RouterMetrics) -> None:
    """One read of the store into the gauges."""
    now = time.time()
    held = await store.held(decode_names, now=now)
    for name, stats in held.items():
        metrics.held.labels(name).set(stats.count)
        oldest = stats.oldest_created_at
        metrics.held_oldest.labels(name).set(max(0.0, now - oldest) if oldest else 0.0)
        metrics.held_expired.labels(name).inc(stats.expired)
    for kind, count in store.kept().items():
        metrics.store_kept.labels(kind).set(count)


async def report_held_forever(
    store: Store, decode_names: Callable[[], list[str]], metrics: RouterMetrics, interval: float
) -> None:
    """A read every ``interval``, of the decode instances there are then."""
    while True:
        try:
            await report_held(store, decode_names(), metrics)
        except StoreUnavailable as exc:
            metrics.store_errors.labels("held").inc()
            log.debug("held handles not read: %s", exc)
        await asyncio.sleep(interval)
