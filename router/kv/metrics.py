"""Metrics of the KV index (docs/operations.md, Metrics)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from carryover.router.metrics import Counter, Gauge

__all__ = ["KvMetrics"]


class KvMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        r = registry
        self.blocks = Gauge(
            "carryover_kv_index_blocks",
            "Blocks the KV index holds for the instance (all tiers).",
            ["server"],
            multiprocess_mode="livemostrecent",
            registry=r,
        )
        self.events = Counter(
            "carryover_kv_events",
            "KV events applied to the index.",
            ["server"],
            registry=r,
        )
        self.skipped = Counter(
            "carryover_kv_events_skipped",
            "Stored blocks or events not indexed, by why.",
            ["server", "why"],
            registry=r,
        )
        self.replays = Counter(
            "carryover_kv_event_replays",
            "Replays asked of the engine after a gap in its event sequence, by outcome.",
            ["server", "outcome"],
            registry=r,
        )
        self.resets = Counter(
            "carryover_kv_index_resets",
            "Times an instance's entries were dropped, by cause.",
            ["server", "cause"],
            registry=r,
        )
        self.lag = Gauge(
            "carryover_kv_event_lag_seconds",
            "Age of the newest applied batch when it was applied (engine clock vs ours).",
            ["server"],
            multiprocess_mode="livemax",
            registry=r,
        )
        self.cached_tokens = Counter(
            "carryover_kv_cached_tokens",
            "Prompt tokens the chosen instance already held, by leg (index hits).",
            ["leg"],
            registry=r,
        )
        self.queried_tokens = Counter(
            "carryover_kv_queried_tokens",
            "Prompt tokens of turns routed with the index, by leg.",
            ["leg"],
            registry=r,
        )
        self.warm_up = Gauge(
            "carryover_warm_tier_up",
            "1 while the warm tier answers its health check (always 1 without one).",
            ["tier"],
            multiprocess_mode="livemostrecent",
            registry=r,
        )
        self.warm_turns = Counter(
            "carryover_warm_tier_turns",
            "Turns without a handle whose prompt's start the warm tier held, by outcome.",
            ["tier", "outcome"],
            registry=r,
        )
        self.warm_tokens = Counter(
            "carryover_warm_tier_tokens",
            "Prompt tokens the warm tier held for the turns routed to it (not computed by P).",
            ["tier"],
            registry=r,
        )

    def forget(self, server: str) -> None:
        """A member that left: its series go (they come back with it)."""
        for metric in vars(self).values():
            if isinstance(metric, Counter | Gauge):
                metric.forget("server", server)
