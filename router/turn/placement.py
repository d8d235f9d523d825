"""What the KV index says each instance holds of this turn's prompt, for the pickers in
``router.fleet.policy``. The index only chooses instances; what is sent is decided by the plan."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

from carryover.router.fleet.instance import Instance
from carryover.router.fleet.policy import Held, nothing_known
from carryover.router.kv.index import Cached, Prompt
from carryover.router.kv.service import KvEvents
from carryover.router.kv.warm import WarmOutcome
from carryover.state import HashedTokens

__all__ = ["KvView", "LegChoice"]


@dataclass(frozen=True)
class LegChoice:
    """The instance a leg chose, and what the KV-event index said of it (the turn's log
    line): the prompt's leading tokens it held, and the most any candidate held (``None``:
    no index, unchecked ids, or candidates not given)."""

    instance: str
    indexed: int | None = None
    most_indexed: int | None = None


class KvView:
    """One turn's view of the index: each instance's and each warm tier's holding of the
    prompt, looked up at most once a turn (the P pick, every attempt's D pick and the
    metrics all ask). A cache of lookups, not a decision: what it answers never changes
    within the turn's view of the index."""

    def __init__(
        self,
        kv: KvEvents | None,
        ids: list[int] | None,
        cache_salt: str | None,
        hashed: HashedTokens | None,
    ) -> None:
        enabled = kv is not None and kv.enabled and ids is not None
        self._kv = kv if enabled else None
        self.prompt = (
            Prompt(ids, cache_salt, packed=hashed.packed if hashed is not None else None)
            if enabled and ids is not None
            else None
        )
        self._cached: dict[str, Cached | None] = {}
        self._warm: dict[str, int] = {}

        def held(instance: Instance, *, warm: bool) -> int | None:
            cached = self.cached(instance)
            own = None if cached is None else cached.tokens
            shared = self.warm(instance) if warm else None
            if shared is None or not shared[1] or not shared[2]:
                return own
            return max(own or 0, shared[2])

        #: Tokens of the prompt each instance holds (all its tiers), ``None`` when unknown.
        self.holding: Held = (
            functools.partial(held, warm=False) if self.prompt is not None else nothing_known
        )
        #: The same with what the model's warm tier holds while it is up (the P leg: every P
        #: of the model shares the tier).
        self.holding_warm: Held = (
            functools.partial(held, warm=True) if self.prompt is not None else nothing_known
        )

    def cached(self, instance: Instance) -> Cached | None:
        """What the index says ``instance`` holds of the prompt."""
        if self.prompt is None or self._kv is None:
            return None
        name = instance.name
        if name not in self._cached:
            self._cached[name] = self._kv.index.cached(name, self.prompt)
        return self._cached[name]

    def on_device(self, instance: Instance) -> int:
        """Leading tokens of the prompt ``instance`` holds on its device (0 when unknown)."""
        cached = self.cached(instance)
        return cached.device_tokens if cached is not None else 0

    def warm(self, instance: Instance) -> tuple[str, bool, int] | None:
        """The warm tier ``instance`` reaches: its name, whether it is up, and how many
        leading tokens of the prompt it holds (every P of the model shares the tier)."""
        if self.prompt is None or self._kv is None:
            return None
        tier = self._kv.warm.get(instance.name)
        if tier is None:
            return None
        tokens = self._warm.get(tier.name)
        if tokens is None:
            tokens = self._warm[tier.name] = tier.held(self.prompt)
        return tier.name, tier.up, tokens

    def choice(self, leg: str, instance: Instance, among: Sequence[Instance] = ()) -> LegChoice:
        """The instance chosen for ``leg`` among ``among`` (the turn's log line); the
        index's hits on it are counted (``carryover_kv_cached_tokens``). The most held is
        over the candidates the rule already looked up: none is looked up for the log."""
        cached = self.cached(instance)
        weighed = (self._cached.get(i.name) for i in among)
        held = [c.tokens for c in weighed if c is not None]
        if cached is not None and self._kv is not None and self.prompt is not None:
            self._kv.metrics.queried_tokens.labels(leg).inc(len(self.prompt.ids))
            self._kv.metrics.cached_tokens.labels(leg).inc(cached.tokens)
        return LegChoice(
            instance.name,
            indexed=cached.tokens if cached is not None else None,
            most_indexed=max(held) if held else None,
        )

    def loads_warm(self, instance: Instance) -> bool:
        """A P leg without a handle: whether P loads more of the prompt from the warm tier
        than it holds itself (the turn then runs warm); counted, and so is a tier that is
        down when it would have."""
        shared = self.warm(instance)
        if shared is None or self._kv is None:
            return False
        name, up, tokens = shared
        own = self.on_device(instance)
        if tokens <= own:
            return False
        metrics = self._kv.metrics
        if not up:
            metrics.warm_turns.labels(name, WarmOutcome.DOWN).inc()
            return False
        metrics.warm_turns.labels(name, WarmOutcome.HIT).inc()
        metrics.warm_tokens.labels(name).inc(tokens - own)
        return True

    def warm_stored(self, instance: Instance) -> None:
        """P answered a leg without a handle: it saved the prompt's whole chunks to the tier."""
        if self.prompt is None or self._kv is None:
            return
        tier = self._kv.warm.get(instance.name)
        if tier is not None and tier.up:
            tier.stored(self.prompt)
