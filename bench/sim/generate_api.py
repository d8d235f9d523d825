"""``/inference/v1/generate`` of a simulated ``vllm serve --tokens-only`` (vLLM 0.32
``entrypoints/scale_out/token_in_token_out``): token ids in, token ids out, no tokenizer.

What it keeps of vLLM: ``sampling_params`` without ``max_tokens`` runs to the end of the
context (the server-side default); stop strings are refused (nothing detokenizes); the
answer's ``request_id`` is ``generate-tokens-`` and the request's; a whole answer carries
``kv_transfer_params``, a stream never does, and its last token comes with the finish
reason; ``return_token_ids`` adds the prompt's ids (a stream's first chunk only).
"""

from __future__ import annotations

import secrets
import time
from typing import TYPE_CHECKING, Any

from aiohttp import web

from carryover.bench.sim.engine import EngineError, Finished, GenerationRequest, SimEngine, Token
from carryover.bench.sim.http import SseSender, error, ok
from carryover.bench.sim.responses import usage_of

if TYPE_CHECKING:
    from carryover.bench.sim.server import SimServer

__all__ = ["cache_salt", "generate"]


def cache_salt(body: dict[str, Any]) -> str | None:
    """The request's ``cache_salt``, refused as vLLM refuses it when it is not a non-empty
    string (``protocol.py``, ``check_cache_salt_support``)."""
    salt = body.get("cache_salt")
    if salt is not None and (not isinstance(salt, str) or not salt):
        raise EngineError(400, "Parameter 'cache_salt' must be a non-empty string if provided.")
    return salt


def _error(exc: EngineError) -> web.Response:
    return error(exc.status, str(exc), exc.kind)


def _request(server: SimServer, body: dict[str, Any]) -> tuple[GenerationRequest, str]:
    ids = body.get("token_ids")
    vocab = server.template.vocab_size
    if (
        not isinstance(ids, list)
        or not ids
        or not all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < vocab for i in ids)
    ):
        raise EngineError(400, "token_ids must be a non-empty list of valid token ids")
    sampling = body.get("sampling_params")
    if not isinstance(sampling, dict):
        raise EngineError(400, "sampling_params must be an object")
    if sampling.get("stop"):
        raise EngineError(400, "stop strings are not supported in tokens-only mode")
    if sampling.get("temperature") not in (None, 0, 0.0):
        raise EngineError(400, "the simulator is deterministic: temperature must be 0")
    if sampling.get("n", 1) != 1:
        raise EngineError(400, "n must be 1")
    kv = body.get("kv_transfer_params")
    if kv is not None and not isinstance(kv, dict):
        raise EngineError(400, "kv_transfer_params must be an object")
    salt = cache_salt(body)
    if salt is not None:
        server.cache_salts.add(salt)
    prompt = list(ids)
    if server.faults.alter_prompt and len(prompt) > 1:
        prompt = prompt[:-1]
    max_tokens = sampling.get("max_tokens")
    if max_tokens is None:
        max_tokens = server.config.max_model_len - len(prompt)
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
        raise EngineError(400, "max_tokens must be a positive integer")
    kwargs = (body.get("reasoning_parser_kwargs") or {}).get("chat_template_kwargs") or {}
    request_id = str(body.get("request_id") or secrets.token_hex(8))
    gen = GenerationRequest(
        request_id=SimEngine.new_request_id(request_id),
        prompt=prompt,
        max_tokens=max_tokens,
        ignore_eos=bool(sampling.get("ignore_eos")),
        thinking=kwargs.get("enable_thinking") is True,
        kv_params=dict(kv) if kv is not None else None,
        cache_salt=salt,
    )
    return gen, f"generate-tokens-{request_id}"


async def generate(server: SimServer, request: web.Request) -> web.StreamResponse:
    fault = await server.faults_before()
    if fault is not None:
        return fault
    try:
        body = await server.body_of(request)
        model = server.check_model(body)
        gen, response_id = _request(server, body)
    except EngineError as exc:
        return _error(exc)
    server.last_traceparent = request.headers.get("traceparent")
    base = {"request_id": response_id, "model": model, "created": int(time.time())}
    with_ids = bool(body.get("return_token_ids"))
    if body.get("stream"):
        options = body.get("stream_options") or {}
        usage = isinstance(options, dict) and bool(options.get("include_usage"))
        return await _stream(server, request, gen, base, with_ids=with_ids, usage=usage)
    ids: list[int] = []
    finished: Finished | None = None
    try:
        async for event in server.engine.generate(gen):
            if isinstance(event, Token):
                ids.append(event.token_id)
            else:
                finished = event
    except EngineError as exc:
        return _error(exc)
    assert finished is not None
    choice = {
        "index": 0,
        "finish_reason": finished.reason,
        "stop_reason": finished.stop_reason,
        "token_ids": ids,
        "logprobs": None,
    }
    answer = {
        **base,
        "output_mode": "tokens",
        "usage": usage_of(gen, ids, finished),
        "prompt_logprobs": None,
        "prompt_token_ids": gen.prompt if with_ids else None,
        "kv_transfer_params": finished.kv_params,
        "choices": [choice],
    }
    return ok(answer)


async def _stream(
    server: SimServer,
    request: web.Request,
    gen: GenerationRequest,
    base: dict[str, Any],
    *,
    with_ids: bool,
    usage: bool,
) -> web.StreamResponse:
    events = server.engine.generate(gen)
    try:
        first = await anext(events)  # errors before the first token are HTTP errors
    except EngineError as exc:
        return _error(exc)
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    sender = SseSender(request, response, lambda: server.faults.drop_stream_after)
    send = sender.send

    def chunk(ids: list[int], finished: Finished | None) -> dict[str, Any]:
        choice = {
            "index": 0,
            "finish_reason": finished.reason if finished else None,
            "stop_reason": finished.stop_reason if finished else None,
            "token_ids": ids,
            "logprobs": None,
        }
        payload = {**base, "output_mode": "tokens", "choices": [choice]}
        if with_ids and sender.sent == 0:
            payload["prompt_token_ids"] = gen.prompt
        return payload

    ids: list[int] = []
    held: list[int] = []  # the newest token waits: the last one goes out with the finish reason
    event: Token | Finished | None = first
    async with sender.ending(events):
        while event is not None:
            if isinstance(event, Token):
                if held:
                    await send(chunk(held, None))
                held = [event.token_id]
                ids.append(event.token_id)
                event = await anext(events, None)
                continue
            await send(chunk(held, event))
            if usage:
                await send(
                    {
                        **base,
                        "output_mode": "tokens",
                        "choices": [],
                        "usage": usage_of(gen, ids, event),
                    }
                )
            await response.write(b"data: [DONE]\n\n")
            break
    return response
