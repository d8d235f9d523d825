"""The router's Prometheus metrics (names documented in docs/operations.md, Metrics).

With several workers (``carryover serve --workers N``) every worker writes its samples to
files in ``PROMETHEUS_MULTIPROC_DIR`` (prometheus_client's multiprocess mode, set up by
``carryover.router.cli``) and ``/metrics`` answers, from whichever worker takes the scrape, the sum over
all of them: one consistent view per router. Each gauge says how its workers' values combine.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable
from typing import Any, Self

import prometheus_client
from prometheus_client import CollectorRegistry, disable_created_metrics, generate_latest
from prometheus_client import multiprocess as _multiprocess

__all__ = [
    "MULTIPROC_ENV",
    "Counter",
    "Gauge",
    "Histogram",
    "RouterMetrics",
    "multiprocess_dir",
    "turn_bucket",
    "turn_label",
]

#: Where prometheus_client's multiprocess mode keeps each worker's samples.
MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"


def multiprocess_dir() -> str | None:
    return os.environ.get(MULTIPROC_ENV) or None


class _RemembersChildren:
    """``labels(*values)`` looked up in a dict of the children already made: the library's
    own call validates, converts and locks every time (about 3 µs), and a turn makes about
    ten. A child removed (``remove``, ``forget``, ``clear``) is forgotten here too, so a
    remembered child is always the registered one: an instance that leaves and comes back
    under its name reports again."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._children: dict[tuple[object, ...], Self] = {}

    def labels(self, *values: object, **by_name: object) -> Self:
        if by_name:
            return super().labels(*values, **by_name)  # type: ignore[misc, no-any-return]
        child = self._children.get(values)
        if child is None:
            made: Self = super().labels(*values)  # type: ignore[misc]
            child = self._children[values] = made
        return child

    def remove(self, *values: object) -> None:
        wanted = tuple(str(v) for v in values)
        self._children = {k: c for k, c in self._children.items() if tuple(map(str, k)) != wanted}
        super().remove(*values)  # type: ignore[misc]

    def clear(self) -> None:
        self._children = {}
        super().clear()  # type: ignore[misc]

    def forget(self, label: str, value: str) -> None:
        """Every child whose ``label`` is ``value``, gone from the registry."""
        names: tuple[str, ...] = self._labelnames  # type: ignore[attr-defined]
        if label not in names:
            return
        index = names.index(label)
        made: dict[tuple[str, ...], Any] = self._metrics  # type: ignore[attr-defined]
        gone = [k for k in list(made) if k[index] == value]
        if not gone:
            return
        self._children = {k: c for k, c in self._children.items() if str(k[index]) != value}
        for key in gone:
            super().remove(*key)  # type: ignore[misc]


class Counter(_RemembersChildren, prometheus_client.Counter):
    pass


class Gauge(_RemembersChildren, prometheus_client.Gauge):
    pass


class Histogram(_RemembersChildren, prometheus_client.Histogram):
    pass


_LATENCY = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
# Time to first token is what the turn-by-turn report reads (router/report): a median is
# interpolated within one bucket, so the buckets are tight where first tokens usually land.
_TTFT = (
    *(0.01, 0.02, 0.03, 0.04, 0.05, 0.06, 0.08, 0.1, 0.125, 0.15, 0.2, 0.25, 0.3, 0.4),
    *(0.5, 0.75, 1, 1.5, 2, 3, 5, 10, 30),
)


def turn_label(turn: int | None, conversation: bool) -> str:
    """The ``turn`` label of a turn's latencies: its bucket, or empty (Prometheus reads an
    empty label as none) for a request without a conversation, whose turn means nothing."""
    return turn_bucket(turn or 1) if conversation else ""


def turn_bucket(turn: int) -> str:
    """Turn index as a bounded label: 1, 2, 3-5, 6-10, 11-20, 21+."""
    if turn <= 2:
        return str(max(turn, 1))
    for high, label in ((5, "3-5"), (10, "6-10"), (20, "11-20")):
        if turn <= high:
            return label
    return "21+"


class RouterMetrics:
    def __init__(self) -> None:
        disable_created_metrics()  # type: ignore[no-untyped-call]  # _created only doubles a scrape
        r = self.registry = CollectorRegistry()
        self.multiprocess = multiprocess_dir() is not None
        # Gauges read from the router's state when scraped. In multiprocess mode a scrape
        # reads files, not other workers' memory: each worker writes them (``publish``).
        self._sampled: list[tuple[Gauge, Callable[[], float]]] = []
        self.turns = Counter(
            "carryover_turns",
            "Served turns by model and the path the client was told.",
            ["model", "path"],
            registry=r,
        )
        self.prompt_tokens = Counter(
            "carryover_prompt_tokens",
            "Prompt tokens by how P got them.",
            ["model", "kind"],
            registry=r,
        )
        self.ttft = Histogram(
            "carryover_ttft_seconds",
            "Time to first streamed byte, by model and turn index (no turn without a "
            "conversation).",
            ["model", "turn"],
            buckets=_TTFT,
            registry=r,
        )
        self.prefilled = Histogram(
            "carryover_prefill_done_seconds",
            "Time from a request's arrival to P's answer (the prompt's KV ready for D), "
            "streamed or not, by model and turn index: what a handle shortens.",
            ["model", "turn"],
            buckets=_TTFT,
            registry=r,
        )
        self.answered = Histogram(
            "carryover_answer_seconds",
            "Time from a request's arrival to its whole answer, by model, turn index and "
            "whether it streamed.",
            ["model", "turn", "stream"],
            buckets=_LATENCY,
            registry=r,
        )
        self.responses = Counter(
            "carryover_responses",
            "Responses to inference requests by model (empty until the model is known), "
            "HTTP status and error type (empty for a success).",
            ["model", "status", "error"],
            registry=r,
        )
        self.stream_errors = Counter(
            "carryover_stream_errors",
            "Streams that ended in an error event after their 200, by model and error type.",
            ["model", "error"],
            registry=r,
        )
        self.e2e = Histogram(
            "carryover_request_seconds",
            "Whole request time.",
            ["stream"],
            buckets=_LATENCY,
            registry=r,
        )
        self.loop_lag = Histogram(
            "carryover_event_loop_lag_seconds",
            "How late the worker's event loop ran a timer set every 0.1 s: what every request "
            "waits beyond its own work at each step.",
            buckets=_LATENCY,
            registry=r,
        )
        self.gc_pauses = Histogram(
            "carryover_gc_pause_seconds",
            "Length of each garbage collection pass, by generation: the worker's loop stops "
            "while it runs.",
            ["generation"],
            buckets=_LATENCY,
            registry=r,
        )
        self.legs = Histogram(
            "carryover_leg_seconds",
            "Time of each step of a turn.",
            ["leg"],
            buckets=_LATENCY,
            registry=r,
        )
        self.store_errors = Counter(
            "carryover_store_errors", "Store calls that failed.", ["op"], registry=r
        )
        self.retries = Counter(
            "carryover_retries", "Upstream retries by cause.", ["cause"], registry=r
        )
        self.releases = Counter(
            "carryover_handles_released",
            "Handles released to D without reuse.",
            ["cause"],
            registry=r,
        )
        self.handles_held = Counter(
            "carryover_handles_held",
            "Handles that came into the router's hands, by origin (router/handles/ledger.py).",
            ["origin"],
            registry=r,
        )
        self.handle_fates = Counter(
            "carryover_handle_fates",
            "Held handles that reached their final state, by fate and cause: once idle, "
            "these add up to carryover_handles_held_total.",
            ["fate", "cause"],
            registry=r,
        )
        self.handles_open = Gauge(
            "carryover_handles_open",
            "Handles held now, their fate not yet settled.",
            multiprocess_mode="livesum",
            registry=r,
        )
        self.ledger_errors = Counter(
            "carryover_handle_ledger_errors",
            "A second final state for one handle: a bug, ignored and counted.",
            registry=r,
        )
        self.no_handle = Counter(
            "carryover_turns_without_handle",
            "Finished turns that left no handle.",
            ["cause"],
            registry=r,
        )
        self.up = Gauge(
            "carryover_instance_up",
            "1 if the instance answers health checks.",
            ["server", "role"],
            multiprocess_mode="livemostrecent",
            registry=r,
        )
        self.draining = Gauge(
            "carryover_instance_draining",
            "1 once every live worker of this router has the instance draining (an admin's "
            "drain, kept in the store for the whole fleet).",
            ["server"],
            multiprocess_mode="livemin",
            registry=r,
        )
        self.breaker_open = Gauge(
            "carryover_breaker_open",
            "1 if the instance's circuit is open or half-open.",
            ["server"],
            multiprocess_mode="livemax",
            registry=r,
        )
        self.handle_age = Histogram(
            "carryover_handle_age_seconds",
            "Age of a stored handle when the conversation's next turn claimed it.",
            buckets=(1, 5, 15, 30, 60, 120, 300, 600, 1800),
            registry=r,
        )
        self.held = Gauge(
            "carryover_decode_handles",
            "Handles of stored records whose KV blocks the decode instance holds.",
            ["server"],
            multiprocess_mode="livemostrecent",
            registry=r,
        )
        self.held_oldest = Gauge(
            "carryover_decode_handle_oldest_age_seconds",
            "Age of the oldest such handle (0 when there is none).",
            ["server"],
            multiprocess_mode="livemostrecent",
            registry=r,
        )
        self.store_kept = Gauge(
            "carryover_store_kept",
            "What the store keeps in this router's memory, by kind (records and DELETE fences "
            "in process; decode names the Redis store carries in every record script).",
            ["kind"],
            multiprocess_mode="livemax",
            registry=r,
        )
        self.held_expired = Counter(
            "carryover_decode_handles_expired_unused",
            "Stored handles that expired unclaimed (the conversation never came back or ended "
            "without DELETE); counted by the replica that noticed, so sum over replicas.",
            ["server"],
            registry=r,
        )
        self.tenant_conversations = Gauge(
            "carryover_tenant_conversations",
            "Live conversation records of each tenant with a conversations limit, fleet-wide, "
            "as this router last read them from the store (the least of its workers' reads).",
            ["tenant"],
            registry=r,
            multiprocess_mode="livemin",
        )
        self.tenant_pinned_tokens = Gauge(
            "carryover_tenant_pinned_tokens",
            "Tokens decode instances pin for each limited tenant's live conversations, "
            "fleet-wide, as this router last read them (the least of its workers' reads).",
            ["tenant"],
            registry=r,
            multiprocess_mode="livemin",
        )
        self.tenant_limited = Counter(
            "carryover_tenant_limited",
            "Requests refused with 429 because their tenant was at a limit: concurrent_turns "
            "(in this router process), conversations or pinned_tokens (fleet-wide).",
            ["tenant", "limit"],
            registry=r,
        )
        self.unchecked = Counter(
            "carryover_turns_unchecked",
            "Turns whose prompt ids the router could not check, by the field (or condition) "
            "that kept it from rendering them: no handle attached, the engine renders.",
            ["field"],
            registry=r,
        )
        self.left_to_expire = Counter(
            "carryover_handles_left_to_expire",
            "Handles neither surely stored nor released (a store call whose outcome is "
            "unknown): D frees their blocks at its TTL.",
            ["cause"],
            registry=r,
        )
        self.restarts = Counter(
            "carryover_instance_restarts",
            "Restarts of an instance this replica noticed (a new process start time, or refused "
            "connections before it answered again); a decode restart makes its records stale.",
            ["server", "role"],
            registry=r,
        )
        self.render_check = Gauge(
            "carryover_render_check",
            "The default renderer's state per model, 1 for the current one: agrees renders in "
            "this process, the others through P's /tokenize.",
            ["model", "state"],
            multiprocess_mode="livemax",
            registry=r,
        )
        self.in_flight = Gauge(
            "carryover_in_flight",
            "Requests in flight.",
            multiprocess_mode="livesum",
            registry=r,
        )
        self.instance_in_flight = Gauge(
            "carryover_instance_in_flight",
            "Requests this router has in flight at the instance.",
            ["server"],
            multiprocess_mode="livesum",
            registry=r,
        )

        self.discovered = Counter(
            "carryover_instances_discovered",
            "Instances that joined (first healthy probe) or left (no longer resolved) a "
            "dns:// set, by role and change.",
            ["role", "change"],
            registry=r,
        )
        self.discovery_errors = Counter(
            "carryover_discovery_errors",
            "Resolutions of a dns:// set that failed or found nothing (its last members kept).",
            ["name"],
            registry=r,
        )

    def instance_up(self, name: str, role: str, up: bool) -> None:
        self.up.labels(name, role).set(1 if up else 0)

    def forget_instance(self, name: str) -> None:
        """An instance that left the fleet: its series go rather than stay at their last
        value."""
        children = {id(self.instance_in_flight.labels(name)), id(self.breaker_open.labels(name))}
        self._sampled = [(g, read) for g, read in self._sampled if id(g) not in children]
        for metric in vars(self).values():
            if isinstance(metric, _RemembersChildren):
                metric.forget("server", name)

    def sampled(self, gauge: Gauge, read: Callable[[], float]) -> None:
        """``gauge`` reads ``read()``: when scraped in one process, else at each ``publish``."""
        if self.multiprocess:
            self._sampled.append((gauge, read))
            gauge.set(read())
        else:
            gauge.set_function(read)

    def publish(self) -> None:
        """Write the sampled gauges where other workers' scrapes read them (multiprocess)."""
        for gauge, read in self._sampled:
            gauge.set(read())

    async def publish_forever(self, interval: float = 1.0) -> None:
        """Keep the sampled gauges fresh for other workers' scrapes (at most ``interval``
        old); nothing to do in one process."""
        while self._sampled:
            self.publish()
            await asyncio.sleep(interval)

    def render(self) -> bytes:
        """The scrape: this process's registry, or every worker's samples combined."""
        if not self.multiprocess:
            data: bytes = generate_latest(self.registry)
            return data
        self.publish()
        combined = CollectorRegistry()
        _multiprocess.MultiProcessCollector(combined)  # type: ignore[no-untyped-call]
        merged: bytes = generate_latest(combined)
        return merged

    def worker_exited(self) -> None:
        """Drop this worker's live gauges (its counters stay: they keep counting up)."""
        if self.multiprocess:
            _multiprocess.mark_process_dead(os.getpid())  # type: ignore[no-untyped-call]
