"""How a turn speaks to its model's engines: the bodies of the three legs, and how D's answer
becomes the client's. One object per engine API (``ModelConfig.engine_api``); the turn's
stages call it and never ask which API they speak."""

from __future__ import annotations

from collections.abc import AsyncGenerator
from typing import TYPE_CHECKING, Any, Protocol

from carryover.router.config import ModelConfig
from carryover.router.fleet.instance import Instance
from carryover.router.relay import DecodeOutput
from carryover.router.turn.model import Leg, Prepared, Started, TurnRequest
from carryover.router.turn.openai_api import OpenAIApi
from carryover.router.turn.tokens_api import TokensApi

if TYPE_CHECKING:
    from carryover.router.turn.services import TurnServices

__all__ = ["EngineApi", "engine_api"]


class EngineApi(Protocol):
    def prefill(self, req: TurnRequest, prepared: Prepared, kv: dict[str, Any]) -> Leg:
        """P computes one token of the checked ids, pulling the history with ``kv``."""
        ...

    def decode(self, req: TurnRequest, prepared: Prepared, p_params: dict[str, Any] | None) -> Leg:
        """D runs the checked ids with P's dict verbatim (``None``: no P, D computes)."""
        ...

    def release(self, model_name: str, kv: dict[str, Any]) -> Leg:
        """A one-token P request whose handle has nothing to pull: D frees the blocks."""
        ...

    async def answer(
        self,
        svc: TurnServices,
        req: TurnRequest,
        prepared: Prepared,
        answer: dict[str, Any],
        output: DecodeOutput,
    ) -> bytes:
        """D's whole answer (already collected into ``output`` and committed), as the
        client gets it."""
        ...

    def frames(
        self,
        svc: TurnServices,
        req: TurnRequest,
        prepared: Prepared,
        started: Started,
        output: DecodeOutput,
    ) -> AsyncGenerator[bytes, None]:
        """D's stream as the client's SSE frames up to D's ``[DONE]`` (not included), each
        chunk collected into ``output`` on the way."""
        ...

    async def after_stream(
        self,
        svc: TurnServices,
        req: TurnRequest,
        prepared: Prepared,
        output: DecodeOutput,
        decode: Instance,
    ) -> None:
        """A stream that ended well without D's handle, before its commit: the handle, if
        the API can still get one (a tokens-only stream returns none)."""
        ...


_OPENAI = OpenAIApi()
_TOKENS = TokensApi()


def engine_api(model: ModelConfig) -> EngineApi:
    return _TOKENS if model.tokens_only else _OPENAI
