"""What the KV index says each instance holds of this turn's prompt, for the pickers in
``router.policy``. The index only chooses instances; what is sent is decided by the plan."""

from __future__ import annotations

from router.kv.index import Cached, Prompt
from router.policy import Held
from router.pool import Instance
from router.turn.model import Prepared
from router.turn.services import TurnServices

__all__ = ["cached_on", "holding", "note_choice"]


def _unknown(_: Instance) -> int | None:
    return None


def _prompt(svc: TurnServices, prepared: Prepared) -> Prompt | None:
    if svc.kv is None or not svc.kv.enabled or prepared.ids is None:
        return None
    if prepared.kv_prompt is None:
        prepared.kv_prompt = Prompt(prepared.ids)
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


def holding(svc: TurnServices, prepared: Prepared) -> Held:
    """Tokens of the prompt each instance holds (all tiers), ``None`` when unknown."""
    if _prompt(svc, prepared) is None:
        return _unknown

    def held(instance: Instance) -> int | None:
        cached = _cached(svc, prepared, instance.name)
        return None if cached is None else cached.tokens

    return held


def cached_on(svc: TurnServices, prepared: Prepared, instance: Instance) -> Cached | None:
    return _cached(svc, prepared, instance.name)


def note_choice(svc: TurnServices, prepared: Prepared, leg: str, instance: Instance) -> None:
    """Count the index's hits on the chosen instance (``carryover_kv_cached_tokens``)."""
    cached = _cached(svc, prepared, instance.name)
    if cached is None or svc.kv is None:
        return
    svc.kv.metrics.queried_tokens.labels(leg).inc(len(prepared.ids or ()))
    svc.kv.metrics.cached_tokens.labels(leg).inc(cached.tokens)
