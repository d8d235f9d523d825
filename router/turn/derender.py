"""The tokens-only end of a turn (docs/tokens-pipeline.md): D's token answer derendered by
the render server, whole or in batches, or detokenized here when no parser needs to see it."""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncGenerator
from typing import TYPE_CHECKING, Any

import msgspec
from tokenizers import Tokenizer

from router.errors import UpstreamError, sse_error
from router.metrics import turn_bucket
from router.relay import DecodeOutput
from router.tokens.answers import StreamMender, mend_whole
from router.tokens.detok import LocalDetokenizer
from router.tokens.stream import Coalescer, derendered_stream
from router.turn.commit import commit
from router.turn.model import Prepared, TurnRequest
from router.turn.services import TurnServices

if TYPE_CHECKING:
    from router.turn.decode import Started

__all__ = ["client_request", "derender_whole", "plain_detokenizer", "stream_tokens"]

log = logging.getLogger("carryover.turn")


async def derender_whole(
    svc: TurnServices,
    req: TurnRequest,
    prepared: Prepared,
    generated: dict[str, Any],
) -> bytes:
    engine_answer = {k: v for k, v in generated.items() if k != "kv_transfer_params"}
    prompt_tokens = len(prepared.generate["token_ids"]) if prepared.generate else 0
    with svc.leg(req, "derender"):
        answer = await svc.render_server(req.model).derender(
            engine_answer, prompt_tokens, client_request(req), chat=req.chat
        )
    mended = mend_whole(answer, generated, client_wants_ids=req.client_wants_ids, chat=req.chat)
    return msgspec.json.encode(mended)


def plain_detokenizer(
    svc: TurnServices, req: TurnRequest, generate: dict[str, Any]
) -> LocalDetokenizer | None:
    """A detokenizer in this process for a stream no parser needs to see: no reasoning
    parser, no tools a tool parser would parse, no logprobs to resolve; ``None`` otherwise
    (docs/tokens-pipeline.md)."""
    check = svc.tokens_checks.get(id(req.model))
    if check is None or check.tokenizer is None:
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
        check.tokenizer,
        model=req.model_name,
        skip_special_tokens=bool(sampling.get("skip_special_tokens", True)),
    )


def _logprob_tokenizer(svc: TurnServices, req: TurnRequest) -> Tokenizer | None:
    """The tokenizer that fills in streamed logprobs the render server's parsed path leaves
    out; none when the client hides reasoning (vLLM then sends no logprobs: their tokens
    would show the reasoning) or no tokenizer here agrees with the server's."""
    check = svc.tokens_checks.get(id(req.model))
    if check is None or req.body.get("include_reasoning") is False:
        return None
    return check.tokenizer


def client_request(req: TurnRequest) -> dict[str, Any]:
    body = dict(req.body)
    body["model"] = req.model_name
    return body


async def stream_tokens(
    svc: TurnServices, req: TurnRequest, prepared: Prepared, started: Started
) -> AsyncGenerator[bytes, None]:
    """A streamed tokens-only answer: D's token chunks derendered in batches."""
    assert started.first is not None and started.lines is not None
    assert prepared.generate is not None
    output = DecodeOutput(client_wants_ids=req.client_wants_ids)
    mender = StreamMender(client_wants_ids=req.client_wants_ids, chat=req.chat)
    settings = req.model.tokens
    local = plain_detokenizer(svc, req, prepared.generate)
    coalescer = Coalescer(
        local or svc.render_server(req.model),
        client_request(req),
        prepared.generate["token_ids"],
        chat=req.chat,
        mender=mender,
        # Detokenizing here costs no call: every chunk goes out as it comes.
        max_tokens=1 if local else settings.stream_tokens,
        max_wait=0.0 if local else settings.stream_interval,
        logprob_tokenizer=_logprob_tokenizer(svc, req),
    )
    started.held.enter_context(
        svc.leg(req, "decode", **{"carryover.instance": started.decode.name})
    )
    async with started.held:
        frames = derendered_stream(started.first, started.lines, coalescer, output)
        try:
            first = True
            async for frame in frames:
                yield frame
                if first:
                    first = False
                    svc.metrics.ttft.labels(turn_bucket(req.turn or 1)).observe(
                        time.monotonic() - req.started
                    )
            started.lease.succeeded()
        except UpstreamError as exc:
            started.lease.failed(exc)
            log.warning("decode stream failed mid-way: %s", exc.message)
            yield sse_error(exc)
            yield b"data: [DONE]\n\n"
            return
        finally:
            await frames.aclose()
        if mender.content:
            output.add_content(mender.content)
        await commit(svc, req, prepared, output, started.decode, started.prefill, streamed=True)
        svc.metrics.e2e.labels("true").observe(time.monotonic() - req.started)
        yield b"data: [DONE]\n\n"
