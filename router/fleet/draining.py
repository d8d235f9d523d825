"""What every worker of every router replica must agree on, kept in the store: which
instances are draining. An admin's drain reaches the process it lands on at once and every
other one at its next refresh (``health_interval``); with the in-process store there is one
router process and the store is its memory."""

from __future__ import annotations

import asyncio
import logging

from carryover.router.fleet.instance import Instance
from carryover.router.fleet.pool import InstancePool
from carryover.router.metrics import RouterMetrics
from carryover.state import Store, StoreUnavailable

__all__ = ["drain", "refresh_draining", "refresh_draining_forever"]

log = logging.getLogger("carryover.fleet")


async def drain(store: Store, pool: InstancePool, instance: Instance, draining: bool) -> None:
    """Mark ``instance`` draining (or not) for the whole fleet; raises ``StoreUnavailable``
    when the store cannot take it (nothing changed anywhere)."""
    await store.set_draining(instance.name, draining)
    _apply(pool, {instance.name} if draining else set(), only=instance)


async def refresh_draining(store: Store, pool: InstancePool, metrics: RouterMetrics) -> None:
    try:
        names = await store.draining()
    except StoreUnavailable as exc:  # kept as last read: draining is never guessed away
        metrics.store_errors.labels("draining").inc()
        log.debug("draining instances not read: %s", exc)
        return
    _apply(pool, names)
    for instance in pool.instances:
        metrics.draining.labels(instance.name).set(1 if instance.draining else 0)


def _apply(pool: InstancePool, names: set[str], *, only: Instance | None = None) -> None:
    for instance in [only] if only is not None else pool.instances:
        draining = instance.name in names
        if draining != instance.draining:
            log.info("instance %s %s", instance.name, "draining" if draining else "in service")
        instance.draining = draining


async def refresh_draining_forever(
    store: Store, pool: InstancePool, metrics: RouterMetrics, interval: float
) -> None:
    while True:
        await refresh_draining(store, pool, metrics)
        await asyncio.sleep(interval)
