"""Keeps each router process's view of the tenants' live conversations (fleet-wide, from the
store) for the ``conversations`` limit (router/tenants/limits.py)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from router.metrics import RouterMetrics
from router.tenants.limits import TenantGate
from state import Store, StoreUnavailable

__all__ = ["count_conversations_forever"]

log = logging.getLogger("carryover.tenants")


async def count_conversations_forever(
    store: Store,
    decode_names: list[str],
    gate: TenantGate,
    metrics: RouterMetrics,
    *,
    interval: float,
    clock: Callable[[], float],
) -> None:
    """Every ``interval``: one read of the live records by tenant. A failed read keeps the
    last view (the limit is soft either way)."""
    while True:
        try:
            gate.conversations = await store.conversations_by_tenant(decode_names, now=clock())
            for tenant in gate.limited_tenants:
                metrics.tenant_conversations.labels(tenant).set(gate.conversations.get(tenant, 0))
        except StoreUnavailable as exc:
            metrics.store_errors.labels("tenant_usage").inc()
            log.debug("tenants' conversations not read: %s", exc)
        await asyncio.sleep(interval)
