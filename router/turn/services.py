"""What every stage of a turn reads: the pool, the store, the engines, the metrics, the
ledger and the background tasks. A record of dependencies: the stages read its fields and
call them; it decides nothing itself."""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from carryover.router.config import RouterConfig
from carryover.router.engines.upstream import Upstream
from carryover.router.fleet.policy import Affinity
from carryover.router.fleet.pool import InstancePool
from carryover.router.handles.ledger import HandleLedger
from carryover.router.kv.service import KvEvents
from carryover.router.metrics import RouterMetrics
from carryover.router.tenants.limits import TenantGate
from carryover.router.turn.background import Background
from carryover.router.turn.release import Releaser
from carryover.state import HashedTokens, Plan, PlanSettings, Record, Store, plan

__all__ = ["Planner", "TurnServices"]


class Planner(Protocol):
    """``state.plan``'s signature: a claimed record and the prompt in, what to send P out."""

    def __call__(
        self,
        record: Record | None,
        prompt: Sequence[int] | HashedTokens,
        *,
        now: float,
        decode_epoch: int | None,
        settings: PlanSettings,
    ) -> Plan: ...


@dataclass
class TurnServices:
    config: RouterConfig
    pool: InstancePool
    store: Store
    upstream: Upstream
    metrics: RouterMetrics
    rng: random.Random = field(default_factory=random.Random)
    clock: Callable[[], float] = time.time  # wall clock: records, expiry, DELETE fences
    planner: Planner = plan
    kv: KvEvents | None = None  # the KV-event index; None or empty: routing by load alone
    gate: TenantGate | None = None  # per-tenant limits; None: none
    background: Background = field(default_factory=Background)
    ledger: HandleLedger = field(init=False)
    affinity: Affinity = field(init=False)

    def __post_init__(self) -> None:
        release = Releaser(self.config, self.pool, self.upstream, self.rng)
        self.ledger = HandleLedger(self.metrics, release, self.background.run)
        self.affinity = Affinity(self.config.affinity_slack, self.config.affinity_tokens_per_load)
