"""One served model at run time: its configuration and everything a turn of it uses, built
once at start and resolved once per request (``router/http/services.py``). A turn's stages
get it with the request and never look a model's parts up elsewhere."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from carryover.router.config import ModelConfig
from carryover.router.engines.upstream import Upstream
from carryover.router.render.backends import Renderer
from carryover.router.tokens.check import TokensCheck
from carryover.router.tokens.server import RenderServerClient
from carryover.router.turn.api import EngineApi, engine_api

__all__ = ["ModelRuntime", "Models"]


@dataclass(eq=False)
class ModelRuntime:
    """``name`` is the served name once known: configured, or the first the engines list
    (``router/http/readiness.py`` learns it); ``served``: every id the engines list;
    ``max_model_len``: the context its engines list for it (``None``: not listed yet)."""

    config: ModelConfig
    renderer: Renderer
    api: EngineApi
    tokens_check: TokensCheck | None = None  # tokens-only models: the render server's verdict
    render_server: RenderServerClient | None = None  # tokens-only models
    name: str | None = None
    served: set[str] | None = None
    max_model_len: int | None = None

    @property
    def render(self) -> RenderServerClient:
        """A tokens-only model's render server (the configuration requires one)."""
        assert self.render_server is not None
        return self.render_server


@dataclass
class Models:
    """Every configured model's runtime, in configuration order."""

    runtimes: list[ModelRuntime] = field(default_factory=list)

    @classmethod
    def build(
        cls, models: Sequence[ModelConfig], renderers: Sequence[Renderer], upstream: Upstream
    ) -> Models:
        runtimes = []
        for model, renderer in zip(models, renderers, strict=True):
            tokens = model.tokens_only and model.render.url is not None
            runtimes.append(
                ModelRuntime(
                    model,
                    renderer,
                    engine_api(model),
                    tokens_check=TokensCheck() if model.tokens_only else None,
                    render_server=RenderServerClient(
                        upstream, model.render.url or "", model.render.timeout
                    )
                    if tokens
                    else None,
                    name=model.name,
                )
            )
        return cls(runtimes)

    def __iter__(self) -> Iterator[ModelRuntime]:
        return iter(self.runtimes)

    def __len__(self) -> int:
        return len(self.runtimes)

    def of(self, model: ModelConfig) -> ModelRuntime:
        """The runtime of a model an instance belongs to (background work: relief, an
        instance leaving), found by the configuration object itself."""
        return next(runtime for runtime in self.runtimes if runtime.config is model)
