"""vLLM's own metric names for a simulated instance (``docs/vllm-protocol.md`` §6)."""

from __future__ import annotations

import time

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    disable_created_metrics,
    generate_latest,
)

__all__ = ["EngineMetrics"]


class EngineMetrics:
    def __init__(self, model_name: str, *, num_blocks: int = 0, block_size: int = 16) -> None:
        disable_created_metrics()  # type: ignore[no-untyped-call]
        self.registry = CollectorRegistry()
        labels = {"model_name": model_name, "engine": "0"}
        names = list(labels)

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> Counter:
            made = Counter(name, doc, [*names, *extra], registry=self.registry)
            if not extra:
                made.labels(**labels)  # exposed at 0 from the start, as vLLM does
            return made

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, names, registry=self.registry)

        self._labels = labels
        self._running = gauge("vllm:num_requests_running", "Requests in the running batch.")
        self._waiting = gauge("vllm:num_requests_waiting", "Requests waiting to be scheduled.")
        self._usage = gauge("vllm:kv_cache_usage_perc", "KV cache usage (1 = 100%).")
        self._pinned = gauge(
            "sim:pinned_handles", "Finished turns whose blocks D holds for a later turn (sim only)."
        )
        self._pinned_usage = gauge(
            "sim:pinned_kv_usage_perc",
            "Share of the KV cache held by pinned turns (1 = 100%, sim only).",
        )
        # vLLM's CacheConfig.metrics_info: every field a label of an info gauge set to 1.
        Gauge(
            "vllm:cache_config_info",
            "Information of the LLMEngine CacheConfig",
            ["block_size", "num_gpu_blocks", "kv_cache_size_tokens", "engine"],
            registry=self.registry,
        ).labels(str(block_size), str(num_blocks), str(num_blocks * block_size), "0").set(1)
        self._queries = counter("vllm:prefix_cache_queries", "Prefix cache queries, in tokens.")
        self._hits = counter("vllm:prefix_cache_hits", "Prefix cache hits, in tokens.")
        self._by_source = counter(
            "vllm:prompt_tokens_by_source", "Prompt tokens by source.", ("source",)
        )
        self.prompt_sources(0, 0, 0)
        self._prompt = counter("vllm:prompt_tokens", "Prompt tokens processed.")
        self._generation = counter("vllm:generation_tokens", "Generation tokens produced.")
        self._success = counter(
            "vllm:request_success", "Finished requests by reason.", ("finished_reason",)
        )
        self._failed = counter("vllm:nixl_num_failed_transfers", "Failed NIXL transfers.")
        self._expired = counter("vllm:nixl_num_kv_expired_reqs", "Declined expired reads.")
        self._after_expiry = counter(
            "vllm:nixl_num_notifications_after_expiry", "Reads of blocks no longer held."
        )
        self._transfers = counter("vllm:nixl_xfer_tokens", "Tokens read over NIXL (sim only).")
        self._preemptions = counter(
            "vllm:num_preemptions", "Requests preempted: blocks taken back, recomputed later."
        )
        self._expired_pins = counter(
            "sim:expired_pins", "Pinned turns released at their TTL, never read (sim only)."
        )
        # vLLM's /metrics carries the default process collector; a router reads a restart here.
        self._start = Gauge(
            "process_start_time_seconds", "Start time of the engine.", registry=self.registry
        )
        self.restarted()

    def restarted(self) -> None:
        self._start.set(time.time())

    def set_gauges(
        self, *, running: int, waiting: int, usage: float, pinned: int, pinned_usage: float
    ) -> None:
        self._running.labels(**self._labels).set(running)
        self._waiting.labels(**self._labels).set(waiting)
        self._usage.labels(**self._labels).set(usage)
        self._pinned.labels(**self._labels).set(pinned)
        self._pinned_usage.labels(**self._labels).set(pinned_usage)

    def queries(self, tokens: int, hits: int) -> None:
        self._queries.labels(**self._labels).inc(tokens)
        self._hits.labels(**self._labels).inc(hits)

    def prompt_sources(self, computed: int, cached: int, external: int) -> None:
        for source, value in (
            ("local_compute", computed),
            ("local_cache_hit", cached),
            ("external_kv_transfer", external),
        ):
            self._by_source.labels(**self._labels, source=source).inc(value)

    def generated(self, prompt: int, output: int) -> None:
        self._prompt.labels(**self._labels).inc(prompt)
        self._generation.labels(**self._labels).inc(output)

    def preempted(self) -> None:
        self._preemptions.labels(**self._labels).inc()

    def finished(self, reason: str) -> None:
        self._success.labels(**self._labels, finished_reason=reason).inc()

    def failed_transfer(self, *, expired: bool) -> None:
        self._failed.labels(**self._labels).inc()
        if expired:
            self._expired.labels(**self._labels).inc()

    def notification_after_expiry(self) -> None:
        self._after_expiry.labels(**self._labels).inc()

    def pin_expired(self) -> None:
        self._expired_pins.labels(**self._labels).inc()

    def transferred(self, tokens: int) -> None:
        self._transfers.labels(**self._labels).inc(tokens)

    def render(self) -> bytes:
        data: bytes = generate_latest(self.registry)
        return data
