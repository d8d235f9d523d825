"""A simulated vLLM instance's answers: whole, or streamed as server-sent events, in the
shapes vLLM's OpenAI server gives them (chat and completions, token ids when asked)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any

from aiohttp import web

from carryover.bench.sim.answers import split_reasoning
from carryover.bench.sim.engine import EngineError, Finished, GenerationRequest, SimEngine, Token
from carryover.bench.sim.http import SseSender, error, ok

__all__ = ["streamed_answer", "usage_of", "whole_answer"]


async def whole_answer(
    engine: SimEngine, gen: GenerationRequest, meta: dict[str, Any]
) -> web.Response:
    """The request's whole answer, as vLLM's OpenAI server writes it."""
    ids: list[int] = []
    text = ""
    finished: Finished | None = None
    try:
        async for event in engine.generate(gen):
            if isinstance(event, Token):
                ids.append(event.token_id)
                text += event.text
            else:
                finished = event
    except EngineError as exc:
        return error(exc.status, str(exc), exc.kind)
    assert finished is not None
    usage = usage_of(gen, ids, finished)
    if meta["chat"]:
        reasoning, content = split_reasoning(text) if gen.thinking else (None, text)
        message: dict[str, Any] = {"role": "assistant", "content": content, "tool_calls": []}
        if gen.thinking:
            message["reasoning_content"] = reasoning
        choice: dict[str, Any] = {
            "index": 0,
            "message": message,
            "logprobs": None,
            "finish_reason": finished.reason,
            "stop_reason": finished.stop_reason,
        }
        if meta["return_token_ids"]:
            choice["token_ids"] = ids
        body: dict[str, Any] = {
            "id": meta["id"],
            "object": "chat.completion",
            "created": meta["created"],
            "model": meta["model"],
            "choices": [choice],
            "usage": usage,
            "prompt_logprobs": None,
            "prompt_token_ids": gen.prompt if meta["return_token_ids"] else None,
            "kv_transfer_params": finished.kv_params,
        }
    else:
        choice = {
            "index": 0,
            "text": text,
            "logprobs": None,
            "finish_reason": finished.reason,
            "stop_reason": finished.stop_reason,
            "prompt_logprobs": None,
        }
        if meta["return_token_ids"]:
            choice["prompt_token_ids"] = gen.prompt
            choice["token_ids"] = ids
        body = {
            "id": meta["id"],
            "object": "text_completion",
            "created": meta["created"],
            "model": meta["model"],
            "choices": [choice],
            "usage": usage,
            "kv_transfer_params": finished.kv_params,
        }
    return ok(body)


def usage_of(gen: GenerationRequest, ids: list[int], finished: Finished) -> dict[str, Any]:
    return {
        "prompt_tokens": len(gen.prompt),
        "completion_tokens": len(ids),
        "total_tokens": len(gen.prompt) + len(ids),
        "prompt_tokens_details": {"cached_tokens": finished.cached_tokens},
    }


async def streamed_answer(
    request: web.Request,
    engine: SimEngine,
    gen: GenerationRequest,
    meta: dict[str, Any],
    *,
    include_usage: bool,
    streams_handles: bool,
    drop_after: Callable[[], int | None],
    interval: int = 1,
) -> web.StreamResponse:
    """The request's answer as server-sent events, as vLLM's OpenAI server streams it;
    ``drop_after()`` (a fault) cuts the connection after that many chunks. ``interval``
    (vLLM's --stream-interval): the first token goes at once, then a chunk every
    ``interval`` tokens (a switch between reasoning and content closes a chunk early) and
    whatever is left at the end."""
    events = engine.generate(gen)
    # Errors before the first token are plain HTTP errors, as in vLLM.
    try:
        first = await anext(events)
    except EngineError as exc:
        return error(exc.status, str(exc), exc.kind)
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    sender = SseSender(request, response, drop_after)
    send = sender.send
    chat = meta["chat"]
    obj = "chat.completion.chunk" if chat else "text_completion"
    base = {"id": meta["id"], "object": obj, "created": meta["created"], "model": meta["model"]}

    if chat:
        head: dict[str, Any] = {
            **base,
            "choices": [
                {
                    "index": 0,
                    "delta": {"role": "assistant", "content": ""},
                    "logprobs": None,
                    "finish_reason": None,
                }
            ],
        }
        if meta["return_token_ids"]:
            head["prompt_token_ids"] = gen.prompt
        await send(head)
    ids: list[int] = []
    text = ""
    in_reasoning = False
    sent_prompt_ids = chat

    async def all_events() -> AsyncIterator[Token | Finished]:
        yield first
        async for event in events:
            yield event

    # Tokens not sent yet: their ids, and their text by field (chat: content or reasoning).
    held_ids: list[int] = []
    held_text = ""
    held_field = "content"
    chunks_sent = 0

    async def flush() -> None:
        nonlocal held_ids, held_text, sent_prompt_ids, chunks_sent
        if not held_ids:
            return
        choice: dict[str, Any]
        if chat:
            choice = {
                "index": 0,
                "delta": {held_field: held_text},
                "logprobs": None,
                "finish_reason": None,
            }
        else:
            choice = {"index": 0, "text": held_text, "logprobs": None, "finish_reason": None}
            if meta["return_token_ids"] and not sent_prompt_ids:
                choice["prompt_token_ids"] = gen.prompt
                sent_prompt_ids = True
        if meta["return_token_ids"]:
            choice["token_ids"] = held_ids
        held_ids, held_text, chunks_sent = [], "", chunks_sent + 1
        await send({**base, "choices": [choice]})

    async with sender.ending(events):
        async for event in all_events():
            if isinstance(event, Token):
                ids.append(event.token_id)
                text += event.text
                piece, field = event.text, "content"
                if chat and gen.thinking:
                    if piece == "<think>":
                        in_reasoning, piece = True, ""
                    elif piece == "</think>":
                        in_reasoning, piece = False, ""
                    elif in_reasoning:
                        field = "reasoning_content"
                    elif "</think>" in text and not text.split("</think>", 1)[1].strip("\n"):
                        piece = ""  # the newlines right after </think>
                if held_ids and field != held_field:
                    await flush()
                held_ids.append(event.token_id)
                held_text += piece
                held_field = field
                if chunks_sent == 0 or len(held_ids) >= interval:
                    await flush()
            else:
                await flush()
                end: dict[str, Any] = {
                    "index": 0,
                    "finish_reason": event.reason,
                    "stop_reason": event.stop_reason,
                    "logprobs": None,
                }
                if chat:
                    end["delta"] = {}
                else:
                    end["text"] = ""
                final: dict[str, Any] = {**base, "choices": [end]}
                if streams_handles:  # the finish chunk carries it from 0.33.0
                    final["kv_transfer_params"] = event.kv_params
                await send(final)
                if include_usage:
                    await send({**base, "choices": [], "usage": usage_of(gen, ids, event)})
                await response.write(b"data: [DONE]\n\n")
    return response
