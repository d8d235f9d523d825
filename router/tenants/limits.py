"""Per-tenant limits a router process enforces (docs/security.md): how many turns a tenant
runs at once, how many live conversations it may hold, and the scheduling ``priority`` it may
ask the engines for.

Concurrent turns are counted per router process (a worker): a fleet-wide count would cost a
store round trip per turn. The fleet's limit for a tenant is therefore ``concurrent_turns``
times the workers of all replicas; set it with that in mind. What a tenant holds
(conversations, pinned tokens) is read fleet-wide from the store every ``held_interval``
(``router/tenants/usage.py``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from carryover.router.config import RouterConfig, TenantLimits
from carryover.router.errors import BadRequest, TooManyRequests
from carryover.state import TenantUsage

if TYPE_CHECKING:
    from prometheus_client import Counter

__all__ = ["TenantGate"]


class TenantGate:
    """``limited``: counts refusals by tenant and limit (``carryover_tenant_limited``)."""

    def __init__(self, config: RouterConfig, limited: Counter | None = None) -> None:
        self._limited = limited
        self._default = config.default_tenant_limits
        self._limits = config.tenant_limits
        self._running: dict[str, int] = {}
        #: what each tenant holds, fleet-wide, as last read from the store
        self.usage: dict[str, TenantUsage] = {}

    @staticmethod
    def _limits_holdings(limits: TenantLimits) -> bool:
        return limits.conversations is not None or limits.pinned_tokens is not None

    @property
    def reads_usage(self) -> bool:
        """Whether any tenant's holdings are limited (else they are never read)."""
        return any(map(self._limits_holdings, [self._default, *self._limits.values()]))

    @property
    def limited_tenants(self) -> list[str]:
        """The tenants whose holdings are limited, by their own limits or the default's (the
        default's: every tenant seen holding something)."""
        named = [t for t, limits in self._limits.items() if self._limits_holdings(limits)]
        if not self._limits_holdings(self._default):
            return named
        return named + [t for t in self.usage if t not in self._limits]

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
            self._refused(tenant, "concurrent_turns")
            raise TooManyRequests(
                f"this API key runs {limit} requests at once already; retry when one ends"
            )
        self._running[tenant] = running + 1

    def admit_new(self, tenant: str) -> None:
        """A turn would store a new conversation record for ``tenant``: 429 when the tenant
        holds its limit of live conversations, or of pinned tokens, already."""
        limits = self.limits(tenant)
        held = self.usage.get(tenant, TenantUsage())
        for name, limit, holds in (
            ("conversations", limits.conversations, held.conversations),
            ("pinned_tokens", limits.pinned_tokens, held.pinned_tokens),
        ):
            if limit is not None and holds >= limit:
                self._refused(tenant, name)
                raise TooManyRequests(
                    f"this API key holds its limit of {limit} {name.replace('_', ' ')} "
                    "already; end conversations (DELETE /v1/conversations/{id}) or continue "
                    "existing ones",
                    param="conversation_id",
                )

    def _refused(self, tenant: str, limit: str) -> None:
        if self._limited is not None:
            self._limited.labels(tenant, limit).inc()

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
