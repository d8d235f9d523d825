"""What the KV index says each instance holds of this turn's prompt, for the pickers in
``router.fleet.policy``. The index only chooses instances; what is sent is decided by the plan."""

from __future__ import annotations

from collections.abc import Sequence

from carryover.router.fleet.instance import Instance
from carryover.router.fleet.policy import Held
from carryover.router.kv.index import Cached, Prompt
from carryover.router.kv.warm import WarmOutcome, WarmTier
from carryover.router.turn.model import LegChoice, Prepared, TurnPath
from carryover.router.turn.services import TurnServices

__all__ = ["cached_on", "held_on_device", "holding", "note_choice", "note_warm", "note_warm_stored"]


def _unknown(_: Instance) -> int | None:
    return None


def _prompt(svc: TurnServices, prepared: Prepared) -> Prompt | None:
    if svc.kv is None or not svc.kv.enabled or prepared.ids is None:
        return None
    if prepared.kv_prompt is None:
        hashed = prepared.hashed
        packed = hashed.packed if hashed is not None else None
        prepared.kv_prompt = Prompt(prepared.ids, prepared.cache_salt, packed=packed)
    return prepared.kv_prompt


def _cached(svc: TurnServices, prepared: Prepared, name: str) -> Cached | None:
    """What the index says ``name`` holds of the prompt, looked up once per turn: the P
    pick, the D picks of every attempt and the metrics all ask."""
    prompt = _prompt(svc, prepared)
    if prompt is None or svc.kv is None:
        return None
    if name not in prepared.kv_cached:
        prepared.kv_cached[name] = svc.kv.index.cached(name, prompt)
    return prepared.kv_cached[name]


def _warm(svc: TurnServices, prepared: Prepared, name: str) -> tuple[WarmTier, int] | None:
    """The warm tier ``name`` reaches and how many leading tokens of the prompt it holds,
    walked once per turn: every P of the model shares the tier."""
    prompt = _prompt(svc, prepared)
    if prompt is None or svc.kv is None:
        return None
    tier = svc.kv.warm.get(name)
    if tier is None:
        return None
    tokens = prepared.warm_cached.get(tier.name)
    if tokens is None:
        tokens = prepared.warm_cached[tier.name] = tier.held(prompt)
    return tier, tokens


def holding(svc: TurnServices, prepared: Prepared, *, warm: bool = False) -> Held:
    """Tokens of the prompt each instance holds (all tiers), ``None`` when unknown. ``warm``
    (the P leg): with what the model's warm tier holds while it is up, which every P of the
    model loads by itself."""
    if _prompt(svc, prepared) is None:
        return _unknown

    def held(instance: Instance) -> int | None:
        cached = _cached(svc, prepared, instance.name)
        own = None if cached is None else cached.tokens
        shared = _warm(svc, prepared, instance.name) if warm else None
        if shared is None or not shared[0].up or not shared[1]:
            return own
        return max(own or 0, shared[1])

    return held


def cached_on(svc: TurnServices, prepared: Prepared, instance: Instance) -> Cached | None:
    return _cached(svc, prepared, instance.name)


def held_on_device(svc: TurnServices, prepared: Prepared, instance: Instance) -> int:
    """Leading tokens of the prompt ``instance`` holds on its device, by the index (0 when
    unknown): what it serves without loading anything."""
    cached = _cached(svc, prepared, instance.name)
    return cached.device_tokens if cached is not None else 0


def note_choice(
    svc: TurnServices,
    prepared: Prepared,
    leg: str,
    instance: Instance,
    among: Sequence[Instance] = (),
) -> None:
    """Note the instance chosen for ``leg`` among ``among`` (the turn's log line), and count
    the index's hits on it (``carryover_kv_cached_tokens``). The most held is over the
    candidates the rule already looked up: no lookup is made for the log line."""
    cached = _cached(svc, prepared, instance.name)
    weighed = (prepared.kv_cached.get(i.name) for i in among)
    held = [c.tokens for c in weighed if c is not None]
    prepared.placed[leg] = LegChoice(
        instance.name,
        indexed=cached.tokens if cached is not None else None,
        most_indexed=max(held) if held else None,
    )
    if cached is None or svc.kv is None:
        return
    svc.kv.metrics.queried_tokens.labels(leg).inc(len(prepared.ids or ()))
    svc.kv.metrics.cached_tokens.labels(leg).inc(cached.tokens)


def note_warm(svc: TurnServices, prepared: Prepared, instance: Instance) -> None:
    """A P leg without a handle: if the warm tier holds more of the prompt than P itself,
    the turn runs ``warm`` (P loads that much from the tier); if the tier is down, it runs
    cold, and that is counted."""
    shared = _warm(svc, prepared, instance.name)
    if shared is None or svc.kv is None:
        return
    if prepared.path in (TurnPath.COLD_UNCHECKED, TurnPath.WARM):  # unchecked, or counted
        return
    tier, tokens = shared
    own = _cached(svc, prepared, instance.name)
    if tokens <= (own.device_tokens if own is not None else 0):
        return
    if not tier.up:
        svc.kv.metrics.warm_turns.labels(tier.name, WarmOutcome.DOWN).inc()
        return
    prepared.path = TurnPath.WARM
    svc.kv.metrics.warm_turns.labels(tier.name, WarmOutcome.HIT).inc()
    svc.kv.metrics.warm_tokens.labels(tier.name).inc(tokens - (own.device_tokens if own else 0))


def note_warm_stored(svc: TurnServices, prepared: Prepared, instance: Instance) -> None:
    """P answered a leg without a handle: it saved the prompt's whole chunks to the tier."""
    shared = _warm(svc, prepared, instance.name)
    if shared is not None and shared[0].up and prepared.kv_prompt is not None:
        shared[0].stored(prepared.kv_prompt)
