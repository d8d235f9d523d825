"""One conversation turn, end to end: prepare (render → claim → plan) → P leg → D leg →
commit.

Invariants kept here: a handle is attached only when the prefix check passed on the exact ids
P and D run (they get them as ``prompt_token_ids``); a claimed handle goes to P at most once;
a handle is released only when it is provably not stored (docs/handles.md); a store, render or
engine failure costs reuse, never the request.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable
from typing import Any

from carryover.router.config import RouterConfig
from carryover.router.engines.upstream import Upstream
from carryover.router.fleet.pool import InstancePool
from carryover.router.handles.fates import Event
from carryover.router.handles.ledger import HandleLedger, Origin
from carryover.router.kv.service import KvEvents
from carryover.router.metrics import RouterMetrics
from carryover.router.outcomes import ReleaseCause
from carryover.router.tenants.limits import TenantGate
from carryover.router.turn.decode import complete, start, stream
from carryover.router.turn.model import Relay, TurnOutcome, TurnRequest
from carryover.router.turn.path import REUSED, final_path
from carryover.router.turn.prepare import prepare
from carryover.router.turn.runtime import ModelRuntime
from carryover.router.turn.services import Planner, TurnServices
from carryover.state import Store, plan

__all__ = ["TurnRunner"]


class TurnRunner:
    def __init__(
        self,
        config: RouterConfig,
        pool: InstancePool,
        store: Store,
        upstream: Upstream,
        metrics: RouterMetrics,
        rng: random.Random | None = None,
        *,
        clock: Callable[[], float] = time.time,
        planner: Planner = plan,
        kv: KvEvents | None = None,
        gate: TenantGate | None = None,
    ) -> None:
        self._svc = TurnServices(
            config,
            pool,
            store,
            upstream,
            metrics,
            rng or random.Random(),
            clock=clock,
            planner=planner,
            kv=kv,
            gate=gate or TenantGate(config),
        )

    async def run(self, req: TurnRequest) -> TurnOutcome:
        svc = self._svc
        prepared = await prepare(svc, req)
        try:
            # P leg + D's answer or first chunk: errors here are HTTP errors, and the path is
            # final from here.
            started = await start(svc, req, prepared)
            body: bytes | None = None
            relay: Relay | None = None
            if req.stream:
                chunks = stream(svc, req, prepared, started)
                # A stream with no frame at all (D's first event its [DONE]) is over,
                # committed, and sends [DONE].
                relay = Relay(await anext(chunks, b""), chunks)
            else:
                body = await complete(svc, req, prepared, started)
        except BaseException as exc:
            # The client left, or the turn failed: a claimed handle the stages did not settle
            # meets the fate its stage has for that (router/handles/fates.py).
            claimed = prepared.claimed
            if claimed is not None and not claimed.settled:
                gone = isinstance(exc, asyncio.CancelledError)
                svc.ledger.record(claimed, Event.CLIENT_GONE if gone else Event.TURN_FAILED)
            raise
        path = final_path(prepared.entry, started.notes)
        claimed = prepared.claimed
        outcome = TurnOutcome(
            path,
            body,
            relay,
            prompt_tokens=len(prepared.ids) if prepared.ids is not None else None,
            reused_tokens=prepared.plan.reused_tokens if path in REUSED else 0,
            handle=claimed.so_far if claimed is not None else "none",
            placed=started.placed,
        )
        # The turn in the metrics, once, when its path is final: the one the client is told
        # (``X-Carryover-Path``).
        svc.metrics.turns.labels(req.model_label, path).inc()
        if outcome.prompt_tokens is not None:
            reused = outcome.reused_tokens
            svc.metrics.prompt_tokens.labels(req.model_label, "reused").inc(reused)
            svc.metrics.prompt_tokens.labels(req.model_label, "computed").inc(
                outcome.prompt_tokens - reused
            )
        return outcome

    @property
    def ledger(self) -> HandleLedger:
        return self._svc.ledger

    async def give_back(
        self,
        runtime: ModelRuntime,
        model_name: str,
        handle: dict[str, Any],
        origin: Origin,
        cause: ReleaseCause,
    ) -> bool:
        """Free D's blocks of a handle taken outside a turn (DELETE, pressure relief) now."""
        ledger = self._svc.ledger
        released = ledger.record(
            ledger.hold(origin, handle, (runtime, model_name)), Event.GIVEN_BACK, cause
        )
        return await released if released is not None else False

    async def drain_background(self) -> None:
        await self._svc.background.drain()
