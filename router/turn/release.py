"""How a handle's blocks are freed on D at once: a one-token P request carrying the handle
with ``remote_num_tokens: 0``, so P computes locally and D frees them (docs/handles.md). The
ledger calls it when a handle's fate is ``released``; nothing else does."""

from __future__ import annotations

import logging
import random
from typing import TYPE_CHECKING, Any

from carryover.router.config import RouterConfig
from carryover.router.engines.upstream import Upstream
from carryover.router.errors import UpstreamError
from carryover.router.fleet.policy import pick_prefill
from carryover.router.fleet.pool import InstancePool
from carryover.router.handles.ledger import HeldHandle
from carryover.state import release_handle

if TYPE_CHECKING:
    from carryover.router.turn.runtime import ModelRuntime

__all__ = ["Releaser"]

log = logging.getLogger("carryover.turn")


class Releaser:
    __slots__ = ("_config", "_pool", "_rng", "_upstream")

    def __init__(
        self, config: RouterConfig, pool: InstancePool, upstream: Upstream, rng: random.Random
    ) -> None:
        self._config = config
        self._pool = pool
        self._upstream = upstream
        self._rng = rng

    async def __call__(self, held: HeldHandle) -> bool:
        """Release ``held`` through its target (``TurnRequest.release_target``)."""
        assert held.kv is not None
        runtime, model_name = held.target
        return await self.release(runtime, model_name, held.kv)

    async def release(self, runtime: ModelRuntime, model_name: str, handle: dict[str, Any]) -> bool:
        instance = pick_prefill(self._pool.available(runtime.config, "prefill"), self._rng)
        if instance is None:
            return False
        path, body = runtime.api.release(model_name, release_handle(handle))
        try:
            await self._upstream.post_json(
                f"{instance.url}{path}", body, timeout=self._config.timeouts.prefill
            )
        except UpstreamError as exc:
            log.info("release of a handle failed (D frees it at its TTL): %s", exc.message)
            return False
        return True
