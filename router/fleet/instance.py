"""One instance behind the router as the router sees it (health, load, restarts), and the
circuit breaker that takes it out of rotation when it fails."""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

from carryover.router.config import InstanceConfig, ModelConfig

__all__ = ["Breaker", "Instance", "streams_handles"]


@dataclass
class Breaker:
    """Opens after ``threshold`` consecutive failures that only the engine can have caused;
    after ``reset`` seconds lets one trial request through (half-open); a success closes it.

    A failure is the engine's when it is engine-wide (no connection, a broken stream:
    ``blame`` ``None``), or when error answers or timeouts came for requests of at least
    ``tenants_to_blame`` tenants in the run. An error answer or a timeout only one tenant's
    requests get may be caused by what that tenant sends (a prompt too long for the
    deadline): it fails those requests, never the instance for everyone (docs/security.md)."""

    threshold: int
    reset: float
    tenants_to_blame: int = 1
    failures: int = 0
    opened_at: float | None = None
    trial_in_flight: bool = False
    engine_wide: bool = False
    blamed: set[str] = field(default_factory=set)

    def allows(self, now: float) -> bool:
        if self.opened_at is None:
            return True
        return now - self.opened_at >= self.reset and not self.trial_in_flight

    @property
    def state(self) -> str:
        if self.opened_at is None:
            return "closed"
        return "half_open" if self.trial_in_flight else "open"

    def begin(self) -> bool:
        """A request is going out: if the circuit is open, this is its one trial (True)."""
        if self.opened_at is not None:
            self.trial_in_flight = True
            return True
        return False

    def abandon_trial(self) -> None:
        """The trial ended without a verdict (cancelled, the client's own error, a refused
        handle): the next request may be the trial. The circuit stays open until one is."""
        self.trial_in_flight = False

    def success(self) -> None:
        self.failures = 0
        self.opened_at = None
        self.trial_in_flight = False
        self.engine_wide = False
        self.blamed.clear()

    def failure(self, now: float, tenant: str | None = None) -> None:
        """A failed request; ``tenant``: the engine answered it with an error (whose cause
        may be the request), ``None``: an engine-wide failure."""
        self.failures += 1
        self.trial_in_flight = False
        if tenant is None:
            self.engine_wide = True
        elif len(self.blamed) < self.tenants_to_blame:
            self.blamed.add(tenant)
        engines = self.engine_wide or len(self.blamed) >= self.tenants_to_blame
        if (self.failures >= self.threshold and engines) or self.opened_at is not None:
            self.opened_at = now  # a failed trial opens it for another reset period


@dataclass(eq=False)
class Instance:
    config: InstanceConfig
    role: str  # "prefill" | "decode"
    model: ModelConfig
    breaker: Breaker
    healthy: bool = True
    ever_healthy: bool = False
    draining: bool = False
    discovered: bool = False  # one address of a dns:// set (router/fleet/discovery.py)
    in_flight: int = 0
    running: float = 0.0
    waiting: float = 0.0
    kv_usage: float = 0.0
    kv_capacity: float = 0.0  # tokens of KV its cache holds (0: not known)
    start_time: float | None = None
    version: str | None = None
    epoch: int = 0
    observed_identity: str | None = None  # the process identity the store has from us
    down_since: float | None = field(default=None)
    probe_failures: int = 0
    refused: bool = False  # connections were refused since the last good probe

    # Read several times a turn (picks, leases, metrics labels); the config never changes.
    @functools.cached_property
    def name(self) -> str:
        return self.config.label

    @functools.cached_property
    def url(self) -> str:
        return self.config.url.rstrip("/")

    @property
    def block_size(self) -> int:
        return self.config.block_size or self.model.block_size

    def available(self, now: float) -> bool:
        return self.healthy and not self.draining and self.breaker.allows(now)

    def load(self) -> float:
        """Requests this router has in flight there plus what the engine reports queued, with
        KV pressure as a tie-breaker."""
        return self.in_flight + self.waiting + self.kv_usage


def streams_handles(version: str) -> bool:
    """vLLM returns D's handle on streamed responses from 0.33.0 on (docs/vllm-protocol.md §2)."""
    try:
        major, minor = (int(part) for part in version.split(".")[:2])
    except ValueError:
        return True
    return (major, minor) >= (0, 33)
