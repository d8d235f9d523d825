"""What every stage of a turn uses: the pool, the store, the engines, metrics; timing of legs
and the release of handles."""

from __future__ import annotations

import asyncio
import functools
import logging
import random
import time
from collections.abc import Callable, Coroutine, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, Protocol, TypeVar

from carryover.router.config import RouterConfig
from carryover.router.engines.upstream import Upstream
from carryover.router.errors import UpstreamError
from carryover.router.fleet.policy import Affinity, pick_prefill
from carryover.router.fleet.pool import InstancePool
from carryover.router.handles.ledger import HandleLedger, HeldHandle, Origin
from carryover.router.kv.service import KvEvents
from carryover.router.metrics import Histogram, RouterMetrics
from carryover.router.tenants.limits import TenantGate
from carryover.router.turn.model import TurnRequest
from carryover.router.turn.runtime import ModelRuntime
from carryover.state import HashedTokens, Plan, PlanSettings, Record, Store, plan, release_handle

__all__ = ["Planner", "TurnServices"]

log = logging.getLogger("carryover.turn")

T = TypeVar("T")


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


class _Leg:
    """A step's timer and span (a class, not a generator: a turn times four or five)."""

    __slots__ = ("_histogram", "_span", "_started")

    def __init__(self, histogram: Histogram, span: AbstractContextManager[None]) -> None:
        self._histogram = histogram
        self._span = span
        self._started = 0.0

    def __enter__(self) -> None:
        self._started = time.perf_counter()
        self._span.__enter__()

    def __exit__(
        self,
        kind: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool | None:
        try:
            return self._span.__exit__(kind, exc, tb)
        finally:
            self._histogram.observe(time.perf_counter() - self._started)


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
    background: set[asyncio.Task[Any]] = field(default_factory=set)
    gate: TenantGate | None = None  # per-tenant limits; None: none
    ledger: HandleLedger = field(init=False)

    def __post_init__(self) -> None:
        self.ledger = HandleLedger(self.metrics, self._release_held, self.in_background)

    @functools.cached_property
    def affinity(self) -> Affinity:
        return Affinity(self.config.affinity_slack, self.config.affinity_tokens_per_load)

    def leg(self, req: TurnRequest, name: str, **attributes: Any) -> _Leg:
        """Time one step of the turn: the leg histogram, and a span when tracing is on."""
        return _Leg(self.metrics.legs.labels(name), req.trace.leg(name, **attributes))

    def warm_later(self, req: TurnRequest, answer: str) -> None:
        """Let the renderer tokenize the answer's span now, so the next turn's render (on its
        time to first token) tokenizes only the new message (docs/rendering.md)."""

        async def warm() -> bool:
            try:
                await req.runtime.renderer.warm(req.body, answer)
            except Exception:  # a warm-up that fails costs the next turn's speed only
                log.debug("render warm-up failed", exc_info=True)
                return False
            return True

        self.in_background(warm())

    def hold(self, req: TurnRequest, origin: Origin, kv: dict[str, Any] | None) -> HeldHandle:
        """A handle this turn now holds, in the ledger: released (if that is its fate)
        through the turn's model."""
        return self.ledger.hold(origin, kv, (req.runtime, req.model_name))

    async def _release_held(self, held: HeldHandle) -> bool:
        assert held.kv is not None
        runtime, model_name = held.target
        return await self.release(runtime, model_name, held.kv)

    def in_background(self, work: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
        """Run ``work`` to its end whatever happens to the request (a client that leaves
        cancels the request, never this); shutdown waits for it."""
        task = asyncio.create_task(work)
        self.background.add(task)
        task.add_done_callback(self.background.discard)
        return task

    async def to_the_end(self, work: Coroutine[Any, Any, T]) -> T:
        """``work``'s result; if the caller is cancelled meanwhile (the client left), ``work``
        still finishes: what it decides about a handle must happen."""
        return await asyncio.shield(self.in_background(work))

    async def release(self, runtime: ModelRuntime, model_name: str, handle: dict[str, Any]) -> bool:
        """A one-token P request carrying the handle with ``remote_num_tokens: 0``: P
        computes locally and D frees the blocks at once."""
        instance = pick_prefill(self.pool.available(runtime.config, "prefill"), self.rng)
        if instance is None:
            return False
        path, body = runtime.api.release(model_name, release_handle(handle))
        try:
            await self.upstream.post_json(
                f"{instance.url}{path}", body, timeout=self.config.timeouts.prefill
            )
        except UpstreamError as exc:
            log.info("release of a handle failed (D frees it at its TTL): %s", exc.message)
            return False
        return True
