"""Per-tenant limits a router process enforces before a turn starts (docs/security.md): how
many turns a tenant runs at once, and the scheduling ``priority`` it may ask the engines for.

Concurrent turns are counted per router process (a worker): a fleet-wide count would cost a
store round trip per turn. The fleet's limit for a tenant is therefore ``concurrent_turns``
times the workers of all replicas; set it with that in mind.
"""

from __future__ import annotations

from typing import Any

from router.config import RouterConfig, TenantLimits
from router.errors import BadRequest, TooManyRequests

__all__ = ["TenantGate"]


class TenantGate:
    def __init__(self, config: RouterConfig) -> None:
        self._default = config.default_tenant_limits
        self._limits = config.tenant_limits
        self._running: dict[str, int] = {}

    def limits(self, tenant: str) -> TenantLimits:
        return self._limits.get(tenant, self._default)

    def running(self, tenant: str) -> int:
        return self._running.get(tenant, 0)

    def enter(self, tenant: str) -> None:
        """A turn of ``tenant`` starts; 429 when the tenant runs its limit already. Every
        ``enter`` that returns is paired with one ``leave``."""
        limit = self.limits(tenant).concurrent_turns
        running = self._running.get(tenant, 0)
        if limit is not None and running >= limit:
            raise TooManyRequests(
                f"this API key runs {limit} requests at once already; retry when one ends"
            )
        self._running[tenant] = running + 1

    def leave(self, tenant: str) -> None:
        left = self._running[tenant] - 1
        if left:
            self._running[tenant] = left
        else:
            del self._running[tenant]

    def clamp_priority(self, tenant: str, body: dict[str, Any]) -> None:
        """The request's ``priority`` (vLLM: lower runs sooner), held to the tenant's range:
        by default every request gets 0, whatever it asks."""
        limits = self.limits(tenant)
        asked = body.get("priority", 0)
        if asked is None:
            asked = 0
        if not isinstance(asked, int) or isinstance(asked, bool):
            raise BadRequest("priority must be an integer", param="priority")
        clamped = min(max(asked, limits.priority_min), limits.priority_max)
        if clamped:
            body["priority"] = clamped
        else:
            body.pop("priority", None)
