"""Engines serving the OpenAI API (``engine_api = "openai"``): P and D get the client's body
with the checked ids, and D's answer goes to the client with the internal fields stripped."""

from __future__ import annotations

from collections.abc import AsyncGenerator
from typing import TYPE_CHECKING, Any

from carryover.router.fields import CHAT_FIELDS, COMPLETION_FIELDS
from carryover.router.fleet.instance import Instance
from carryover.router.relay import DecodeOutput
from carryover.router.turn.model import Leg, Prepared, Started, TurnRequest

if TYPE_CHECKING:
    from carryover.router.turn.services import TurnServices

__all__ = ["OpenAIApi"]

# Fields the P leg must not carry: it generates exactly one token and never streams.
_PREFILL_DROP = (
    "max_completion_tokens",
    "min_tokens",
    "min_completion_tokens",
    "stream_options",
    "logprobs",
    "top_logprobs",
    "n",
)


class OpenAIApi:
    def prefill(self, req: TurnRequest, prepared: Prepared, kv: dict[str, Any]) -> Leg:
        # D's body with the handle, cut to an allow-list: P gets only the fields
        # router/fields.py knows. A field vLLM adds later could make P render the prompt
        # itself and cache D's pulled blocks under other ids, which other prompts would then
        # hit; D, which never caches pulled blocks for others, keeps what the client sent
        # (docs/request-fields.md).
        known = CHAT_FIELDS if req.chat else COMPLETION_FIELDS
        path, full = self.decode(req, prepared, kv)
        body = {k: v for k, v in full.items() if k in known and k not in _PREFILL_DROP}
        body["max_tokens"] = 1
        body["stream"] = False
        return path, body

    def decode(self, req: TurnRequest, prepared: Prepared, p_params: dict[str, Any] | None) -> Leg:
        body: dict[str, Any] = dict(req.body)
        body["model"] = req.model_name
        # The ids D ran are the sequence its handle covers (P's: what D's KV is computed from).
        body["return_token_ids"] = True
        # P's dict verbatim (never rewrite remote_host); no P: D computes alone and still
        # returns a handle.
        kv: dict[str, Any] = (
            dict(p_params) if p_params is not None else {"do_remote_prefill": False}
        )
        ids = prepared.ids_raw
        if ids is not None:  # the checked ids: engines run exactly those (docs/request-fields.md)
            if req.chat:
                kv["prompt_token_ids"] = ids
            else:
                body["prompt"] = ids
        body["kv_transfer_params"] = kv
        return req.path, body

    def release(self, model_name: str, kv: dict[str, Any]) -> Leg:
        body = {"model": model_name, "prompt": [0], "max_tokens": 1, "kv_transfer_params": kv}
        return "/v1/completions", body

    async def answer(
        self,
        svc: TurnServices,
        req: TurnRequest,
        prepared: Prepared,
        answer: dict[str, Any],
        output: DecodeOutput,
    ) -> bytes:
        return output.client_body(answer)

    async def frames(
        self,
        svc: TurnServices,
        req: TurnRequest,
        prepared: Prepared,
        started: Started,
        output: DecodeOutput,
    ) -> AsyncGenerator[bytes, None]:
        assert started.first is not None and started.events is not None
        yield output.chunk(started.first)
        async for data in started.events:
            if data == b"[DONE]":
                break
            yield output.chunk(data)

    async def after_stream(
        self,
        svc: TurnServices,
        req: TurnRequest,
        prepared: Prepared,
        output: DecodeOutput,
        decode: Instance,
    ) -> None:
        return None  # the finish chunk carried the handle (vLLM 0.33 and later)
