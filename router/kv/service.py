"""The KV index of a router process and the subscriptions that keep it (one per instance
with ``kv_events``)."""

from __future__ import annotations

import asyncio
import contextlib
import logging

import zmq.asyncio

from carryover.router.config import InstanceConfig, ModelConfig, RouterConfig
from carryover.router.engines.upstream import Upstream
from carryover.router.kv.index import KvIndex
from carryover.router.kv.metrics import KvMetrics
from carryover.router.kv.subscriber import EventSubscriber
from carryover.router.kv.warm import WarmTier, watch_health

__all__ = ["KvEvents"]

log = logging.getLogger("carryover.kv")


class KvEvents:
    def __init__(self, config: RouterConfig, metrics: KvMetrics) -> None:
        self.index = KvIndex()
        self.metrics = metrics
        self._context: zmq.asyncio.Context | None = None
        self.subscribers: dict[str, EventSubscriber] = {}
        self._tasks: list[asyncio.Task[None]] = []  # the warm tiers' health checks
        self._runs: dict[str, asyncio.Task[None]] = {}  # each instance's subscription
        #: Each model's warm tier, by the name of every instance of the model.
        self.warm: dict[str, WarmTier] = {}
        self.warm_tiers: list[WarmTier] = []
        self._tier_of: list[tuple[ModelConfig, WarmTier]] = []  # each model with a tier
        for model in config.models:
            if model.warm_tier is not None:
                tier = WarmTier(model.warm_tier)
                self.warm_tiers.append(tier)
                self._tier_of.append((model, tier))
                for instance in (*model.prefill, *model.decode):
                    self.warm[instance.label] = tier
        self._sources = [
            instance
            for model in config.models
            for instance in (*model.prefill, *model.decode)
            if instance.kv_events is not None and not instance.discovered
        ]
        # dns:// sets with events: their members subscribe as they join.
        self._discovered = any(
            instance.kv_events is not None and instance.discovered
            for model in config.models
            for instance in (*model.prefill, *model.decode)
        )

    def instance_restarted(self, name: str) -> None:
        subscriber = self.subscribers.get(name)
        if subscriber is not None:
            subscriber.restarted()

    @property
    def enabled(self) -> bool:
        """Whether turns consult the index: some engine publishes events, or a warm tier is
        learned from the router's own P legs."""
        return bool(self._sources or self._discovered or self.warm_tiers)

    def start(self) -> None:
        for instance in self._sources:
            self._subscribe(instance)

    def joined(self, instance: InstanceConfig, model: ModelConfig) -> None:
        """A member of a dns:// set: its warm tier, and its events when it publishes them."""
        tier = next((tier for each, tier in self._tier_of if each is model), None)
        if tier is not None:
            self.warm[instance.label] = tier
        if instance.kv_events is not None:
            self._subscribe(instance)

    def left(self, name: str) -> None:
        """A member that left its set: its subscription and what the index knew of it go."""
        run = self._runs.pop(name, None)
        if run is not None:
            run.cancel()
        self.subscribers.pop(name, None)
        self.index.forget(name)
        self.warm.pop(name, None)
        self.metrics.forget(name)

    def _subscribe(self, instance: InstanceConfig) -> None:
        assert instance.kv_events is not None
        if self._context is None:
            self._context = zmq.asyncio.Context()
        name = instance.label
        subscriber = EventSubscriber(
            name,
            instance.kv_events,
            instance.kv_events_replay,
            self.index.of(name),
            self.metrics,
            context=self._context,
            warm=self.warm.get(name),
        )
        self.subscribers[name] = subscriber
        self._runs[name] = asyncio.create_task(self._run(subscriber))

    def watch_warm_tiers(self, http: Upstream, *, interval: float, timeout: float) -> None:
        """Keep each warm tier's ``up`` true to its health check (stopped by ``stop``)."""
        if self.warm_tiers:
            checks = watch_health(
                self.warm_tiers, http, self.metrics.warm_up, interval=interval, timeout=timeout
            )
            self._tasks.append(asyncio.create_task(checks))

    async def _run(self, subscriber: EventSubscriber) -> None:
        # ZMQ reconnects by itself; only an error of ours ends a run, and it starts again.
        while True:
            try:
                await subscriber.run()
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception(
                    "kv events of %s: subscriber failed; starting again", subscriber.instance
                )
                subscriber.blocks.clear()
                subscriber.last = None
                await asyncio.sleep(1.0)

    async def stop(self) -> None:
        tasks = [*self._tasks, *self._runs.values()]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks.clear()
        self._runs.clear()
        if self._context is not None:
            self._context.destroy(linger=0)
            self._context = None
