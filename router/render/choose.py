"""The renderer a model's configuration asks for."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

from carryover.router.config import ModelConfig, RenderConfig, RouterConfig
from carryover.router.engines.upstream import Upstream
from carryover.router.metrics import RouterMetrics
from carryover.router.render.auto import AutoRenderer, RenderCheck, keep_checked
from carryover.router.render.backends import (
    EngineTokenize,
    LocalRenderer,
    Renderer,
    RenderServer,
    local_folder,
)

if TYPE_CHECKING:
    from carryover.router.fleet.instance import Instance
    from carryover.router.fleet.pool import InstancePool

__all__ = ["Renderers", "make_renderer"]

log = logging.getLogger("carryover.render")


def make_renderer(
    config: RenderConfig,
    upstream: Upstream,
    on_check: Callable[[RenderCheck], None] = lambda _: None,
) -> Renderer:
    if config.backend == "server":
        assert config.url is not None
        return RenderServer(upstream, config.url, config.timeout)
    if config.backend == "local":
        return LocalRenderer(local_folder(config), config.span_cache_chars)
    engine = EngineTokenize(upstream, config.timeout)
    if config.backend == "engine":
        return engine
    try:
        local: LocalRenderer | None = LocalRenderer(local_folder(config), config.span_cache_chars)
    except Exception as exc:  # tokenizers raises bare Exceptions
        # Missing or unreadable tokenizer files: the engine renders.
        log.warning("no tokenizer to render with in process (%s); the engine renders", exc)
        local = None
    return AutoRenderer(engine, local, on_change=on_check)


class Renderers:
    """Each model's renderer, and the checks that keep the default ones honest."""

    def __init__(self, config: RouterConfig, upstream: Upstream, metrics: RouterMetrics) -> None:
        self._config = config
        #: Each model's renderer, in configuration order.
        self.renderers: list[Renderer] = []
        for number, model in enumerate(config.models):
            label = model.name or str(number)  # position when the name is discovered later

            def report(state: RenderCheck, label: str = label) -> None:
                for each in RenderCheck:
                    metrics.render_check.labels(label, each).set(1 if each is state else 0)

            self.renderers.append(make_renderer(model.render, upstream, report))
        self._tasks: list[asyncio.Task[None]] = []

    def start(self, pool: InstancePool, names: Callable[[ModelConfig], str | None]) -> None:
        """Check every default renderer against a prefill instance of its model, again after
        any of them restarts."""
        for model, renderer in zip(self._config.models, self.renderers, strict=True):
            if isinstance(renderer, AutoRenderer):
                self._tasks.append(asyncio.create_task(self._check(model, renderer, pool, names)))

    async def _check(
        self,
        model: ModelConfig,
        renderer: AutoRenderer,
        pool: InstancePool,
        names: Callable[[ModelConfig], str | None],
    ) -> None:
        def first_prefill() -> str | None:
            available = pool.available(model, "prefill")
            return available[0].url if available else None

        def restarted(instance: Instance) -> None:
            if instance.role == "prefill" and instance in pool.members(model, "prefill"):
                renderer.recheck()

        pool.on_restart.append(restarted)
        await keep_checked(
            renderer, lambda: names(model), first_prefill, self._config.health_interval
        )

    def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
