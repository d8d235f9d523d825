"""Tokens-only engines (``engine_api = "tokens"``, docs/tokens-pipeline.md): P and D run the
render server's ``GenerateRequest`` over ``/inference/v1/generate``, and D's token answer is
derendered by the render server, whole or in batches, or detokenized here when no parser
needs to see it."""

from __future__ import annotations

import logging
from collections.abc import AsyncGenerator
from typing import TYPE_CHECKING, Any

import msgspec
from tokenizers import Tokenizer

from carryover.router.errors import UpstreamError
from carryover.router.fleet.instance import Instance
from carryover.router.outcomes import NoHandleCause
from carryover.router.relay import DecodeOutput
from carryover.router.tokens.answers import StreamMender, mend_whole
from carryover.router.tokens.detok import LocalDetokenizer
from carryover.router.tokens.legs import (
    GENERATE_PATH,
    capture_request,
    decode_request,
    prefill_request,
    release_request,
)
from carryover.router.tokens.stream import Coalescer, derendered_stream
from carryover.router.turn.model import Leg, Prepared, Started, TokensPrompt, TurnRequest
from carryover.router.turn.timing import timed

if TYPE_CHECKING:
    from carryover.router.turn.services import TurnServices

__all__ = ["TokensApi", "plain_detokenizer"]

_encoder = msgspec.json.Encoder()
log = logging.getLogger("carryover.turn")


def _tokens(prepared: Prepared) -> TokensPrompt:
    assert prepared.tokens is not None  # prepare renders every turn of a tokens-only model
    return prepared.tokens


class TokensApi:
    def prefill(self, req: TurnRequest, prepared: Prepared, kv: dict[str, Any]) -> Leg:
        return GENERATE_PATH, prefill_request(_tokens(prepared).generate, kv)

    def decode(self, req: TurnRequest, prepared: Prepared, p_params: dict[str, Any] | None) -> Leg:
        return GENERATE_PATH, decode_request(
            _tokens(prepared).generate, p_params, stream=req.stream
        )

    def release(self, model_name: str, kv: dict[str, Any]) -> Leg:
        return GENERATE_PATH, release_request(model_name, kv)

    async def answer(
        self,
        svc: TurnServices,
        req: TurnRequest,
        prepared: Prepared,
        answer: dict[str, Any],
        output: DecodeOutput,
    ) -> bytes:
        # Called after the commit: the handle is stored even if derendering fails (the KV
        # is right), and the failure costs the answer only.
        tokens = _tokens(prepared)
        with timed(svc.metrics, req, "derender"):
            derendered = await req.runtime.render.derender(
                answer, len(tokens.ids), tokens.request, chat=req.chat
            )
        mended = mend_whole(
            derendered, answer, client_wants_ids=req.client_wants_ids, chat=req.chat
        )
        return _encoder.encode(mended)

    async def frames(
        self,
        svc: TurnServices,
        req: TurnRequest,
        prepared: Prepared,
        started: Started,
        output: DecodeOutput,
    ) -> AsyncGenerator[bytes, None]:
        assert started.first is not None and started.events is not None
        tokens = _tokens(prepared)
        mender = StreamMender(client_wants_ids=req.client_wants_ids, chat=req.chat)
        settings = req.model.tokens
        local = plain_detokenizer(svc, req, tokens.generate)
        coalescer = Coalescer(
            local or req.runtime.render,
            tokens.request,
            tokens.ids,
            chat=req.chat,
            mender=mender,
            # Detokenizing here costs no call: every chunk goes out as it comes.
            max_tokens=1 if local else settings.stream_tokens,
            max_wait=0.0 if local else settings.stream_interval,
            logprob_tokenizer=_logprob_tokenizer(svc, req),
        )
        frames = derendered_stream(started.first, started.events, coalescer, output)
        try:
            async for frame in frames:
                yield frame
        finally:
            await frames.aclose()
        if mender.content:
            output.add_content(mender.content)

    async def after_stream(
        self,
        svc: TurnServices,
        req: TurnRequest,
        prepared: Prepared,
        output: DecodeOutput,
        decode: Instance,
    ) -> None:
        """vLLM's streamed generate returns no handle, though D keeps the sequence's blocks
        (for ``decoder_kv_blocks_ttl``). A one-token request for prompt and answer on the
        same D finds all but the last partial block in D's prefix cache, computes the rest,
        and returns a handle for the whole sequence: the next turn reuses it."""
        tokens = _tokens(prepared)
        if output.handle is not None:
            return
        # vLLM's streamed generate never returns D's params (0.32, 0.33): what the commit
        # counts unless a capture is tried below.
        output.no_handle = NoHandleCause.STREAMED_GENERATE
        if (
            not req.model.tokens.capture_streamed_handles
            or req.key is None
            or not req.model.reuse
            or not prepared.storable
            or prepared.ids is None
            or output.prompt_ids != prepared.ids  # the commit releases nothing it cannot check
            or output.finish_reason not in ("stop", "length")
        ):
            return
        body = capture_request(tokens.generate, [*prepared.ids, *output.output_ids])
        try:
            with timed(svc.metrics, req, "capture", **{"carryover.instance": decode.name}):
                answer = await svc.upstream.post_json(
                    f"{decode.url}{GENERATE_PATH}",
                    body,
                    timeout=svc.config.timeouts.prefill,
                    headers=req.engine_headers,
                )
        except UpstreamError as exc:
            log.info("capture of a streamed turn's handle failed: %s", exc.message)
            output.no_handle = NoHandleCause.CAPTURE_FAILED
            return
        handle = answer.get("kv_transfer_params") if isinstance(answer, dict) else None
        if not isinstance(handle, dict):
            output.no_handle = NoHandleCause.CAPTURE_FAILED
            return
        output.handle, output.no_handle = handle, None
        output.shadowed = True  # the stream's own pin still holds these blocks


def plain_detokenizer(
    svc: TurnServices, req: TurnRequest, generate: dict[str, Any]
) -> LocalDetokenizer | None:
    """A detokenizer in this process for a stream no parser needs to see: no reasoning
    parser, no tools a tool parser would parse, no logprobs to resolve; ``None`` otherwise
    (docs/tokens-pipeline.md)."""
    check = req.runtime.tokens_check
    if check is None or check.vocabulary is None:
        return None
    sampling = generate.get("sampling_params") or {}
    if sampling.get("logprobs") is not None or sampling.get("prompt_logprobs") is not None:
        return None
    if req.chat:
        settings = req.model.tokens
        tools = req.body.get("tools") and req.body.get("tool_choice") != "none"
        if settings.reasoning_parser is not None or (tools and settings.tool_call_parser):
            return None
    return LocalDetokenizer(
        check.vocabulary,
        model=req.model_name,
        skip_special_tokens=bool(sampling.get("skip_special_tokens", True)),
    )


def _logprob_tokenizer(svc: TurnServices, req: TurnRequest) -> Tokenizer | None:
    """The tokenizer that fills in streamed logprobs the render server's parsed path leaves
    out; none when the client hides reasoning (vLLM then sends no logprobs: their tokens
    would show the reasoning) or no tokenizer here agrees with the server's."""
    check = req.runtime.tokens_check
    if check is None or check.vocabulary is None or req.body.get("include_reasoning") is False:
        return None
    return check.vocabulary.tokenizer
