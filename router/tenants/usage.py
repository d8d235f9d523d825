"""Keeps each router process's view of what every tenant holds (fleet-wide, from the store):
live conversations and pinned decode tokens, for the limits of router/tenants/limits.py."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from carryover.router.metrics import RouterMetrics
from carryover.router.tenants.limits import TenantGate
from carryover.state import Store, StoreUnavailable, TenantUsage

__all__ = ["read_usage_forever"]

log = logging.getLogger("carryover.tenants")


async def read_usage_forever(
    store: Store,
    decode_names: Callable[[], list[str]],
    gate: TenantGate,
    metrics: RouterMetrics,
    *,
    interval: float,
    clock: Callable[[], float],
) -> None:
    """Every ``interval``: one read of what each tenant holds. A failed read keeps the last
    view (the limits are soft either way)."""
    while True:
        try:
            gate.usage = await store.usage_by_tenant(decode_names(), now=clock())
            for tenant in gate.limited_tenants:
                held = gate.usage.get(tenant, TenantUsage())
                metrics.tenant_conversations.labels(tenant).set(held.conversations)
                metrics.tenant_pinned_tokens.labels(tenant).set(held.pinned_tokens)
        except StoreUnavailable as exc:
            metrics.store_errors.labels("tenant_usage").inc()
            log.debug("tenants' conversations not read: %s", exc)
        await asyncio.sleep(interval)
