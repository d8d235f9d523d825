"""A model's warm KV tier as the router sees it (docs/warm-tier.md): what it holds, learned
from the engines' KV events, and whether it answers its health check.

LMCache's server is shared by every engine of a model, so its blocks are indexed once for the
tier, not per engine: each engine's events report the tier's blocks under the tier's medium
(LMCache's MP connector: ``CPU``, in chunks of its own size). What the index says only picks
instances and labels turns; the engine asks the tier itself and computes what it misses, so a
stale entry costs speed, never a wrong answer.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import TYPE_CHECKING

from carryover.router.config import WarmTierConfig
from carryover.router.errors import UpstreamError
from carryover.router.kv.index import InstanceBlocks, Prompt, Tier

if TYPE_CHECKING:
    from prometheus_client import Gauge

    from carryover.router.engines.upstream import Upstream

__all__ = ["WarmOutcome", "WarmTier", "watch_health"]

log = logging.getLogger("carryover.kv")


class WarmOutcome(StrEnum):
    """What the warm tier meant for a turn that attached no handle (a metric label)."""

    #: It held the start of the prompt: the turn ran ``warm``.
    HIT = "hit"
    #: It held the start of the prompt but failed its health check: the turn ran cold.
    DOWN = "down"


@dataclass
class WarmTier:
    config: WarmTierConfig
    blocks: InstanceBlocks = field(default_factory=InstanceBlocks)
    up: bool = True

    def __post_init__(self) -> None:
        self.blocks.block_size = self.config.chunk_tokens

    @property
    def name(self) -> str:
        return self.config.name

    def stored(self, prompt: Prompt) -> None:
        """A P leg on an engine of the tier computed ``prompt``: its whole chunks are stored
        there now (the engine saves what it computed; ``learn_from_prefills``)."""
        size = self.blocks.block_size
        if size is not None and self.config.learn_from_prefills:
            self.blocks.hold(prompt.keys(size), Tier.of(self.config.medium))

    def held(self, prompt: Prompt) -> int:
        """Leading tokens of the prompt the tier holds, whether or not it is up."""
        size = self.blocks.block_size
        if size is None:
            return 0
        return self.blocks.cached(prompt.keys(size)).tokens


async def probe(tier: WarmTier, http: Upstream, *, timeout: float) -> bool:
    """One health check: up when its URL answers 200 in time."""
    assert tier.config.health is not None
    try:
        answer = await http.get(tier.config.health, timeout=timeout)
        up = answer.status_code == 200
    except UpstreamError:
        up = False
    if up != tier.up:
        log.warning("warm tier %s is %s", tier.name, "up again" if up else "down")
    tier.up = up
    return up


async def watch_health(
    tiers: Sequence[WarmTier], http: Upstream, up: Gauge, *, interval: float, timeout: float
) -> None:
    """Probe every tier with a health URL every ``interval`` seconds, forever."""
    checked = [t for t in tiers if t.config.health is not None]
    for tier in tiers:
        up.labels(tier.name).set(1.0)
    while checked:
        for tier in checked:
            try:
                up.labels(tier.name).set(1.0 if await probe(tier, http, timeout=timeout) else 0.0)
            except Exception:  # a probe bug must not stop the checks
                log.exception("warm tier %s: health check failed", tier.name)
        await asyncio.sleep(interval)
