"""``/ready``: can this router serve a turn now? ``/health`` only says the process is alive.

Ready means: the store answers (when one is configured: a router that cannot claim or commit
serves every turn cold and leaks nothing, but a replica that can should take the traffic),
every model's name is known and its engines serve it (a ``--model`` no engine serves answers
every request with 404), a decode instance is available, and a prefill instance is too unless
the model lets D serve alone (``when_prefill_down = "decode-alone"``: then losing every P
degrades turns, it does not stop them, and a fleet of NotReady routers would only block node
drains). Which models engines serve is read from their ``/v1/models`` (``watch_models``).
"""

from __future__ import annotations

import asyncio
import logging
import time

from carryover.router.config import ModelConfig
from carryover.router.errors import CarryoverError
from carryover.router.http.services import Services
from carryover.state import StoreUnavailable

__all__ = ["not_ready", "watch_models"]

log = logging.getLogger("carryover.router")


async def not_ready(services: Services) -> str | None:
    """Why this router cannot serve a turn now, or ``None``."""
    checks = [r.tokens_check for r in services.models if r.tokens_check is not None]
    refusals = [check.refusal for check in checks if check.refusal is not None]
    if refusals:
        return refusals[0]
    if services.config.redis:
        try:
            await services.store.ping()
        except StoreUnavailable:
            return "the conversation store does not answer"
    now = time.monotonic()
    for runtime in services.models:
        model, name, served = runtime.config, runtime.name, runtime.served
        if name is None:
            return "a model's name is not known yet (no engine listed it)"
        if served is not None and name not in served:
            return f"no engine serves the model {name!r} (they serve {sorted(served)})"
        if not _any_available(services, model, "decode", now):
            return f"no healthy decode instance for {name}"
        if model.when_prefill_down != "decode-alone" and not _any_available(
            services, model, "prefill", now
        ):
            return f"no healthy prefill instance for {name}"
    return None


def _any_available(services: Services, model: ModelConfig, role: str, now: float) -> bool:
    return any(i.available(now) for i in services.pool.members(model, role))


async def watch_models(services: Services, interval: float) -> None:
    """Read what the engines serve; a model configured without a name takes the first name
    its engines list. Every ``interval``, once every model is known, to notice a
    redeployed engine serving something else."""
    while True:
        for runtime in services.models:
            listed = await _served(services, runtime.config)
            if listed is None:
                continue
            runtime.served = set(listed)
            if runtime.name is None and listed:
                runtime.name = next(iter(listed))
            runtime.max_model_len = listed.get(runtime.name) if runtime.name else None
        known = all(runtime.served is not None for runtime in services.models)
        await asyncio.sleep(interval if known else 1.0)


async def _served(services: Services, model: ModelConfig) -> dict[str, int | None] | None:
    """The model ids the first answering engine of ``model`` lists, in its order, each with
    its ``max_model_len`` (vLLM's ``ModelCard``; ``None`` where not listed), or ``None``."""
    instances = [
        *services.pool.members(model, "prefill"),
        *services.pool.members(model, "decode"),
    ]
    for instance in instances:
        try:
            answer = await services.upstream.get(f"{instance.url}/v1/models", timeout=2.0)
            data = answer.json()["data"]
            return {
                str(entry["id"]): _context(entry.get("max_model_len"))
                for entry in data
                if isinstance(entry, dict) and "id" in entry
            }
        except (CarryoverError, ValueError, KeyError, TypeError):
            continue
    return None


def _context(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None
