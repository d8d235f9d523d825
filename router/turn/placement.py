"""What the KV index says each instance holds of this turn's prompt, for the pickers in
``router.policy``. The index only chooses instances; what is sent is decided by the plan."""

from __future__ import annotations

from router.kv.index import Prompt
from router.policy import Held
from router.pool import Instance
from router.turn.model import Prepared
from router.turn.services import TurnServices

__all__ = ["holding", "note_choice"]


def _unknown(_: Instance) -> int | None:
    return None


def _prompt(svc: TurnServices, prepared: Prepared) -> Prompt | None:
    if svc.kv is None or not svc.kv.enabled or prepared.ids is None:
        return None
    if prepared.kv_prompt is None:
        prepared.kv_prompt = Prompt(prepared.ids)
    return prepared.kv_prompt


def holding(svc: TurnServices, prepared: Prepared) -> Held:
    """Tokens of the prompt each instance holds (all tiers), ``None`` when unknown."""
    prompt = _prompt(svc, prepared)
    if prompt is None or svc.kv is None:
        return _unknown
    index = svc.kv.index

    def held(instance: Instance) -> int | None:
        cached = index.cached(instance.name, prompt)
        return None if cached is None else cached.tokens

    return held


def note_choice(svc: TurnServices, prepared: Prepared, leg: str, instance: Instance) -> None:
    """Count the index's hits on the chosen instance (``carryover_kv_cached_tokens``)."""
    prompt = _prompt(svc, prepared)
    if prompt is None or svc.kv is None:
        return
    cached = svc.kv.index.cached(instance.name, prompt)
    if cached is None:
        return
    svc.kv.metrics.queried_tokens.labels(leg).inc(len(prompt.ids))
    svc.kv.metrics.cached_tokens.labels(leg).inc(cached.tokens)
