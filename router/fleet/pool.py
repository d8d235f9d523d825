"""The instances behind the router: health, load, circuit breakers and restart epochs.

Load and health may be a second stale; that costs balance, never correctness (a stale epoch
only means P answers a fast 500 and the turn is retried cold).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
import uuid
from collections.abc import Awaitable, Callable, Iterable, Iterator

from carryover.router.config import InstanceConfig, ModelConfig, RouterConfig
from carryover.router.engines.gauges import KV_CAPACITY_TOKENS, parse_gauges
from carryover.router.engines.upstream import Upstream
from carryover.router.errors import EngineFailed, EngineTimeout, EngineUnavailable, UpstreamError
from carryover.router.fleet.discovery import DnsSet, Resolver, members_of, resolve
from carryover.router.fleet.instance import Breaker, Instance, streams_handles
from carryover.router.metrics import RouterMetrics
from carryover.state import Store, StoreUnavailable

__all__ = ["InstancePool", "Lease"]

log = logging.getLogger("carryover.pool")

#: Consecutive failed probes (timeouts, errors) before an instance is taken out of rotation; a
#: refused connection takes it out at once.
_PROBES_TO_DOWN = 3


class Lease:
    """One request's hold on an instance (see :meth:`InstancePool.lease`), for ``tenant``."""

    def __init__(self, pool: InstancePool, instance: Instance, tenant: str) -> None:
        self.instance = instance
        self.tenant = tenant
        self.decided = False
        self._pool = pool

    def succeeded(self) -> None:
        self.decided = True
        self._pool.succeeded(self.instance)

    def failed(self, error: UpstreamError) -> None:
        self.decided = True
        self._pool.failed(self.instance, error, self.tenant)


def _tenants_to_blame(config: RouterConfig) -> int:
    """Error answers of two tenants make an engine's failure; with one tenant (or no keys),
    every error answer counts, as there is no one else to protect."""
    return 2 if len(set(config.api_keys.values())) >= 2 else 1


def _in_flight(instance: Instance) -> float:
    return instance.in_flight


def _breaker_open(breaker: Breaker) -> float:
    return 0 if breaker.state == "closed" else 1


class InstancePool:
    def __init__(
        self,
        config: RouterConfig,
        upstream: Upstream,
        store: Store,
        metrics: RouterMetrics,
        resolver: Resolver = resolve,
    ) -> None:
        self._config = config
        self._upstream = upstream
        self._store = store
        self._metrics = metrics
        self._resolver = resolver
        self.instances: list[Instance] = []
        self.by_name: dict[str, Instance] = {}
        #: The dns:// entries, with the model and role their addresses serve.
        self._sets: list[tuple[DnsSet, ModelConfig, str]] = []
        self._found: dict[str, dict[str, Instance]] = {}  # by set: its members by URL
        for model in config.models:
            for role, group in (("prefill", model.prefill), ("decode", model.decode)):
                for item in group:
                    if item.discovered:
                        self._sets.append((DnsSet(item), model, role))
                    else:
                        self._add(item, role, model)
        self._task: asyncio.Task[None] | None = None
        #: Called with an instance whose process restarted (what it held is gone).
        self.on_restart: list[Callable[[Instance], None]] = []
        #: Called with an instance that joined a dns:// set (at its first healthy probe).
        self.on_join: list[Callable[[Instance], None]] = []
        #: Called with an instance that left its dns:// set (what is stored for it).
        self.on_leave: list[Callable[[Instance], Awaitable[object]]] = []
        self._leaving: set[asyncio.Task[object]] = set()

    def _add(
        self, item: InstanceConfig, role: str, model: ModelConfig, *, discovered: bool = False
    ) -> Instance:
        breaker = Breaker(
            self._config.breaker_failures,
            self._config.breaker_reset,
            _tenants_to_blame(self._config),
        )
        # A discovered instance takes turns from its first healthy probe on.
        instance = Instance(
            item, role, model, breaker, healthy=not discovered, discovered=discovered
        )
        if instance.name in self.by_name:
            raise ValueError(f"instance {instance.name} listed twice")
        self.instances.append(instance)
        self.by_name[instance.name] = instance
        # Read when scraped, not set per request: a lease would set it twice, and every
        # request's outcome would set the breaker's.
        self._metrics.sampled(
            self._metrics.instance_in_flight.labels(instance.name),
            functools.partial(_in_flight, instance),
        )
        self._metrics.sampled(
            self._metrics.breaker_open.labels(instance.name),
            functools.partial(_breaker_open, instance.breaker),
        )
        return instance

    def decodes(self) -> list[Instance]:
        """Every decode instance now (discovered ones come and go)."""
        return [i for i in self.instances if i.role == "decode"]

    # -- discovery ---------------------------------------------------------------------------

    async def discover(self) -> None:
        """Resolve every dns:// set and apply what changed (router/fleet/discovery.py)."""
        for dns, model, role in self._sets:
            try:
                resolved: list[str] | None = await self._resolver(dns.name, dns.port)
            except OSError as exc:
                resolved = None
                log.warning("%s did not resolve (%s): members kept", dns.entry.url, exc)
            if not resolved:
                self._metrics.discovery_errors.labels(dns.entry.url).inc()
            current = [i.url for i in self.members(model, role) if i.discovered and i.config.url]
            change = members_of(dns, current, resolved)
            for item in change.joined:
                if item.label not in self.by_name:
                    log.info("instance %s found by %s", item.label, dns.entry.url)
                    self._add(item, role, model, discovered=True)
            for url in change.left:
                leaving = next(i for i in self.members(model, role) if i.url == url)
                self._leave(leaving)

    def _leave(self, instance: Instance) -> None:
        """No new request goes to ``instance``; what runs there finishes (leases hold the
        object); what is stored for it is the listeners' (handles given back)."""
        instance.draining = True
        self.instances.remove(instance)
        del self.by_name[instance.name]
        self._metrics.forget_instance(instance.name)
        self._metrics.discovered.labels(instance.role, "left").inc()
        log.info("instance %s left its DNS set", instance.name)
        for listener in self.on_leave:
            task: asyncio.Task[object] = asyncio.ensure_future(listener(instance))
            self._leaving.add(task)
            task.add_done_callback(self._left)

    def _left(self, task: asyncio.Task[object]) -> None:
        self._leaving.discard(task)
        if not task.cancelled() and (error := task.exception()) is not None:
            log.warning("handles of a departed instance not given back: %s", error)

    # -- queries -----------------------------------------------------------------------------

    def members(self, model: ModelConfig, role: str) -> list[Instance]:
        return [i for i in self.instances if i.model is model and i.role == role]

    def available(
        self, model: ModelConfig, role: str, exclude: Iterable[Instance] = ()
    ) -> list[Instance]:
        now = time.monotonic()
        skip = set(exclude)
        return [i for i in self.members(model, role) if i not in skip and i.available(now)]

    def epoch_of(self, name: str) -> int | None:
        instance = self.by_name.get(name)
        return instance.epoch if instance is not None else None

    def _last_healthy_decode(self, instance: Instance) -> bool:
        return instance.role == "decode" and not any(
            other.healthy and other is not instance
            for other in self.members(instance.model, instance.role)
        )

    # -- leases: the one way requests touch an instance's counts and breaker -----------------

    @contextlib.contextmanager
    def lease(self, instance: Instance, tenant: str) -> Iterator[Lease]:
        """Hold ``instance`` for one request: counted in flight, and the breaker's one trial
        when its circuit is open. Whatever ends the block (an answer, an error, a client that
        left, a cancellation), the count comes back down, and a trial that got no verdict
        (:meth:`Lease.succeeded` / :meth:`Lease.failed`) is given up for the next request."""
        instance.in_flight += 1
        trial = instance.breaker.begin()
        lease = Lease(self, instance, tenant)
        try:
            yield lease
        finally:
            instance.in_flight -= 1
            if trial and not lease.decided:
                instance.breaker.abandon_trial()

    # -- outcomes of real requests feed the breaker ------------------------------------------

    def succeeded(self, instance: Instance) -> None:
        instance.breaker.success()

    def failed(self, instance: Instance, error: UpstreamError, tenant: str) -> None:
        # An error answer, or a request the engine took and did not finish in time, may be
        # caused by what the tenant sent (a prompt too long for the deadline): it counts
        # against the engine only once several tenants' requests fail (the breaker's rule).
        # No connection is the engine's alone.
        answered = isinstance(error, EngineFailed) and error.upstream_status is not None
        took_it = answered or isinstance(error, EngineTimeout)
        instance.breaker.failure(time.monotonic(), tenant if took_it else None)
        log.warning("instance %s failed: %s", instance.name, error.message)

    # -- background probing ------------------------------------------------------------------

    async def start(self) -> None:
        await self.discover()
        await self.refresh_epochs()
        await self.probe_all()
        self._task = asyncio.create_task(self._loop())

    async def stop(self) -> None:
        for leaving in list(self._leaving):
            leaving.cancel()
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self._config.health_interval)
            try:
                await self.discover()
                await self.refresh_epochs()
                await self.probe_all()
            except Exception:  # a probe bug must not stop health checking
                log.exception("health loop iteration failed")

    async def refresh_epochs(self) -> None:
        """Epochs bumped by other router replicas (one MGET)."""
        names = [i.name for i in self.instances if i.role == "decode"]
        try:
            epochs = await self._store.epochs(names)
        except StoreUnavailable:
            return
        for name, value in epochs.items():
            instance = self.by_name[name]
            instance.epoch = max(instance.epoch, value)

    async def probe_all(self) -> None:
        await asyncio.gather(*(self._probe(i) for i in self.instances))

    async def _probe(self, instance: Instance) -> None:
        """Health, load and restart evidence of one instance.

        A timeout is not a restart: a busy engine (vLLM on CPU, say) can miss a probe. An
        instance counts as restarted when its ``process_start_time_seconds`` changed, or, when
        it publishes none, when it refused connections before it answered again.
        """
        timeout = self._config.timeouts.health
        try:
            response = await self._upstream.get(f"{instance.url}/health", timeout=timeout)
            ok = response.status_code == 200
            refused = False
        except EngineUnavailable:
            ok, refused = False, True
        except UpstreamError:
            ok, refused = False, False
        if not ok:
            instance.probe_failures += 1
            instance.refused = instance.refused or refused
            slow = not refused and instance.probe_failures >= _PROBES_TO_DOWN
            if slow and instance.healthy and self._last_healthy_decode(instance):
                # Slow probes alone do not prove it down, and without it every request would
                # fail at once (a missing P has a fallback, D alone; a missing D has none).
                # Real request failures still open its breaker.
                if instance.probe_failures == _PROBES_TO_DOWN:
                    log.warning(
                        "instance %s misses health probes; kept: it is the last decode instance",
                        instance.name,
                    )
                return
            if instance.healthy and (refused or slow):
                log.warning("instance %s is down", instance.name)
                instance.healthy = False
                instance.down_since = time.monotonic()
                self._metrics.instance_up(instance.name, instance.role, False)
            return
        try:
            metrics = await self._upstream.get(f"{instance.url}/metrics", timeout=timeout)
            gauges = parse_gauges(metrics.text)
        except UpstreamError:
            gauges = {}
        start = gauges.get("process_start_time_seconds")
        if start is not None:
            # A new start time is a new process; refused connections alone were a blip.
            restarted = instance.start_time is not None and start != instance.start_time
            instance.start_time = start
        else:
            restarted = instance.refused and instance.ever_healthy
        instance.running = gauges.get("vllm:num_requests_running", instance.running)
        instance.waiting = gauges.get("vllm:num_requests_waiting", instance.waiting)
        instance.kv_usage = gauges.get("vllm:kv_cache_usage_perc", instance.kv_usage)
        instance.kv_capacity = gauges.get(KV_CAPACITY_TOKENS, instance.kv_capacity)
        if instance.version is None or restarted:
            await self._read_version(instance)
        if restarted:
            self._metrics.restarts.labels(instance.name, instance.role).inc()
            for listener in self.on_restart:
                listener(instance)
        if instance.role == "decode":
            await self._observe_identity(instance, start, restarted=restarted)
        if instance.discovered and not instance.ever_healthy:
            self._metrics.discovered.labels(instance.role, "joined").inc()
            for joined in self.on_join:
                joined(instance)
        if not instance.healthy:
            log.info("instance %s is up", instance.name)
        instance.healthy = True
        instance.ever_healthy = True
        instance.down_since = None
        instance.probe_failures = 0
        instance.refused = False
        self._metrics.instance_up(instance.name, instance.role, True)

    async def _read_version(self, instance: Instance) -> None:
        try:
            response = await self._upstream.get(
                f"{instance.url}/version", timeout=self._config.timeouts.health
            )
            version = response.json().get("version")
        except (UpstreamError, ValueError, AttributeError):
            return
        if isinstance(version, str):
            instance.version = version
            if instance.role == "decode" and not streams_handles(version):
                log.warning(
                    "decode instance %s runs vLLM %s: streamed turns return no handle there "
                    "(its blocks stay pinned for decoder_kv_blocks_ttl); use vLLM >= 0.33.0",
                    instance.name,
                    version,
                )

    async def _observe_identity(
        self, instance: Instance, start: float | None, *, restarted: bool
    ) -> None:
        """The process a decode instance runs as, shared with every replica through the
        store: a new one (a restart, seen by this replica or by another one first) makes the
        records of the old one stale, once. Without a start time to tell processes apart, a
        restart this replica inferred from refused connections counts as a new process."""
        if restarted:
            log.warning("decode instance %s restarted: its stored handles are stale", instance.name)
        if start is not None:
            identity = repr(start)
        elif restarted:
            identity = f"unknown-{uuid.uuid4().hex}"
        elif instance.observed_identity is not None:
            identity = instance.observed_identity
        else:
            return
        # Told again at every probe, not only when it changes: a bump the store lost (a
        # failover before its replica had it) is made again by the next probe of any router.
        try:
            epoch = await self._store.observe_identity(instance.name, identity)
        except StoreUnavailable:
            # Tried again at the next probe; meanwhile no handle of the old process is sent.
            if restarted:
                instance.epoch += 1
            return
        instance.observed_identity = identity
        instance.epoch = max(instance.epoch, epoch)
