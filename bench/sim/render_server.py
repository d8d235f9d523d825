"""A simulated vLLM render server (``vllm launch render``, vLLM 0.32
``entrypoints/scale_out/render`` and ``derender``) for the simulated ``--tokens-only`` engines.

What it keeps of vLLM: the ``GenerateRequest`` shape (the request id ``chatcmpl-`` or
``cmpl-`` and the router's ``X-Request-Id``; ``max_tokens`` clipped to the context, and left
out when it equals ``SamplingParams``' default of 16; the reasoning parser's kwargs); whole
derenders copy the engine's ``kv_transfer_params`` through and say ``stop`` for tool calls;
streaming derenders decode the whole output again on every call (O(n²) over a stream, as
vLLM's parser does). Its reasoning parser is the ``qwen3`` format (``--reasoning-parser``);
it has no tool parser.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from typing import Any

import msgspec
from aiohttp import web

from carryover.bench.sim.answers import split_reasoning
from carryover.bench.sim.chat import SimRenderError, SimTemplate
from carryover.bench.sim.http import error, ok, serve

__all__ = ["RenderSimConfig", "SimRenderServer"]

_decode = msgspec.json.Decoder()
_SAMPLING_DEFAULT_MAX_TOKENS = 16


class _BadRequest(Exception):
    pass


class RenderSimConfig(msgspec.Struct, kw_only=True):
    served_model_name: str
    host: str = "127.0.0.1"
    port: int = 8010
    max_model_len: int = 32768
    reasoning_parser: str | None = None


class _Faults(msgspec.Struct):
    fail_render: int = 0  # the next N renders answer 500
    fail_derender: int = 0  # the next N derenders (whole or chunk) answer 500


class SimRenderServer:
    def __init__(self, config: RenderSimConfig, template: SimTemplate | None = None) -> None:
        self.config = config
        self.template = template or SimTemplate.qwen3()
        self.faults = _Faults()
        self.calls: dict[str, int] = {"render": 0, "derender": 0, "derender_chunk": 0}
        self._runner: web.AppRunner | None = None

    def _app(self) -> web.Application:
        app = web.Application(client_max_size=64 << 20)
        app.add_routes(
            [
                web.get("/health", self.health),
                web.get("/v1/models", self.models),
                web.post("/tokenize", self.tokenize),
                web.post("/v1/chat/completions/render", self.render_chat),
                web.post("/v1/completions/render", self.render_completion),
                web.post("/v1/chat/completions/derender", self.derender_chat),
                web.post("/v1/completions/derender", self.derender_completion),
                web.post("/sim/faults", self.set_faults),
            ]
        )
        return app

    @property
    def url(self) -> str:
        return f"http://{self.config.host}:{self.config.port}"

    async def start(self) -> None:
        """Serve (again, after ``stop``: a restarted render server on the same port)."""
        self._runner = await serve(self._app(), self.config.host, self.config.port)

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def _body(self, request: web.Request) -> dict[str, Any]:
        try:
            body = _decode.decode(await request.read())
        except msgspec.DecodeError as exc:
            raise _BadRequest(f"invalid JSON body: {exc}") from exc
        if not isinstance(body, dict):
            raise _BadRequest("the body must be a JSON object")
        model = body.get("model", self.config.served_model_name)
        if model not in (None, self.config.served_model_name):
            raise _BadRequest(f"The model `{model}` does not exist.")
        return body

    # -- render ------------------------------------------------------------------------------

    def _sampling(self, body: dict[str, Any], prompt_len: int, *, chat: bool) -> dict[str, Any]:
        if prompt_len > self.config.max_model_len:
            raise _BadRequest(
                f"Input length ({prompt_len}) exceeds model's maximum context length "
                f"({self.config.max_model_len})."
            )
        asked = body.get("max_completion_tokens") if chat else None
        if asked is None:
            asked = body.get("max_tokens")
        room = self.config.max_model_len - prompt_len
        max_tokens = room if asked is None else min(int(asked), room)
        sampling: dict[str, Any] = {}
        if max_tokens != _SAMPLING_DEFAULT_MAX_TOKENS:  # vLLM omits fields at their default
            sampling["max_tokens"] = max_tokens
        for name in ("temperature", "seed", "n", "ignore_eos", "stop", "logprobs"):
            if body.get(name) not in (None, False, [], ""):
                sampling[name] = body[name]
        return sampling

    def _generate_request(
        self,
        request: web.Request,
        body: dict[str, Any],
        ids: list[int],
        sampling: dict[str, Any],
        prefix: str,
    ) -> dict[str, Any]:
        """The ``GenerateRequest`` of one rendered prompt; its id is ``prefix`` and the
        caller's ``X-Request-Id``."""
        stream = bool(body.get("stream"))
        return {
            "request_id": f"{prefix}-{request.headers.get('X-Request-Id') or secrets.token_hex(8)}",
            "token_ids": ids,
            "features": None,
            "sampling_params": sampling,
            "model": body.get("model"),
            "stream": stream,
            "stream_options": body.get("stream_options") if stream else None,
        }

    def _kwargs(self, body: dict[str, Any]) -> dict[str, Any]:
        kwargs = body.get("chat_template_kwargs") or {}
        if not isinstance(kwargs, dict):
            raise _BadRequest("chat_template_kwargs must be an object")
        return kwargs

    async def render_chat(self, request: web.Request) -> web.Response:
        self.calls["render"] += 1
        if self._injected("render"):
            return error(500, "render failed (injected)")
        try:
            body = await self._body(request)
            messages = body.get("messages")
            if not isinstance(messages, list) or not messages:
                raise _BadRequest("messages must be a non-empty list")
            ids = await asyncio.to_thread(
                self.template.render,
                messages,
                add_generation_prompt=bool(body.get("add_generation_prompt", True)),
                tools=body.get("tools"),
                chat_template_kwargs=self._kwargs(body),
            )
            sampling = self._sampling(body, len(ids), chat=True)
        except (_BadRequest, SimRenderError, ValueError, TypeError) as exc:
            return error(400, str(exc))
        generate = self._generate_request(request, body, ids, sampling, "chatcmpl")
        generate.update(reasoning_ended=None, reasoning_parser_kwargs=None)
        if self.config.reasoning_parser is not None:
            generate["reasoning_parser_kwargs"] = {"chat_template_kwargs": self._kwargs(body)}
        return ok(generate)

    async def render_completion(self, request: web.Request) -> web.Response:
        self.calls["render"] += 1
        if self._injected("render"):
            return error(500, "render failed (injected)")
        try:
            body = await self._body(request)
            prompt = body.get("prompt")
            if isinstance(prompt, str) and prompt:
                ids = self.template.encode(prompt)
            elif isinstance(prompt, list) and prompt and all(isinstance(i, int) for i in prompt):
                ids = list(prompt)
            else:
                raise _BadRequest("prompt must be a non-empty string or a list of token ids")
            sampling = self._sampling(body, len(ids), chat=False)
        except (_BadRequest, ValueError, TypeError) as exc:
            return error(400, str(exc))
        return ok([self._generate_request(request, body, ids, sampling, "cmpl")])

    # -- derender ----------------------------------------------------------------------------

    def _text(self, ids: list[int]) -> str:
        text = self.template.decode(ids, skip_special_tokens=True)
        return text.rstrip("\ufffd")  # a character whose bytes have not all come yet

    def _parts(self, text: str) -> tuple[str | None, str]:
        """(reasoning, content) as the qwen3 parser splits them; mid-stream, an open think
        block is all reasoning."""
        if self.config.reasoning_parser is None:
            return None, text
        if "</think>" not in text and text.lstrip("\n").startswith("<think>"):
            return text.replace("<think>", "", 1).lstrip("\n"), ""
        return split_reasoning(text)

    def _usage(self, prompt_tokens: int, completion: int) -> dict[str, int]:
        return {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion,
            "total_tokens": prompt_tokens + completion,
        }

    def _injected(self, call: str) -> bool:
        """Whether this call fails: ``fail_render`` or ``fail_derender`` counts down."""
        name = f"fail_{call}"
        left = getattr(self.faults, name)
        if left > 0:
            setattr(self.faults, name, left - 1)
        return bool(left > 0)

    async def derender_chat(self, request: web.Request) -> web.Response:
        if self._injected("derender"):
            return error(500, "derender failed (injected)")
        try:
            body = await self._body(request)
            if body.get("stream"):
                self.calls["derender_chunk"] += 1
                return ok(self._chat_chunk(body))
            self.calls["derender"] += 1
            generated = body["generate_response"]
            choices = []
            for choice in generated["choices"]:
                reasoning, content = self._parts(self._text(choice["token_ids"]))
                message: dict[str, Any] = {"role": "assistant", "content": content}
                message.update(tool_calls=[], reasoning=reasoning)
                choices.append(
                    {
                        "index": choice.get("index", 0),
                        "message": message,
                        "logprobs": None,
                        "finish_reason": choice.get("finish_reason"),
                        "stop_reason": choice.get("stop_reason"),
                    }
                )
            completion = sum(len(c["token_ids"]) for c in generated["choices"])
            answer = {
                "id": generated.get("request_id"),
                "object": "chat.completion",
                "created": generated.get("created") or int(time.time()),
                "model": generated.get("model"),
                "choices": choices,
                "usage": self._usage(int(body.get("prompt_tokens") or 0), completion),
                "kv_transfer_params": generated.get("kv_transfer_params"),
            }
        except (_BadRequest, KeyError, TypeError, ValueError) as exc:
            return error(400, f"bad derender request: {exc}")
        return ok(answer)

    def _chat_chunk(self, body: dict[str, Any]) -> dict[str, Any]:
        chunk = body["generate_chunk"]
        state = dict(body.get("stream_state") or {"ids": [], "reasoning": 0, "content": 0})
        choices = []
        for part in chunk.get("choices") or ():
            state["ids"] = [*state["ids"], *(part.get("token_ids") or ())]
            reasoning, content = self._parts(self._text(state["ids"]))
            delta: dict[str, Any] = {}
            if not state.get("role"):
                delta["role"] = "assistant"
                state["role"] = True
            if reasoning and len(reasoning) > state["reasoning"]:
                delta["reasoning"] = reasoning[state["reasoning"] :]
                state["reasoning"] = len(reasoning)
            if len(content) > state["content"]:
                delta["content"] = content[state["content"] :]
                state["content"] = len(content)
            choices.append(
                {
                    "index": part.get("index", 0),
                    "delta": delta,
                    "logprobs": None,
                    "finish_reason": part.get("finish_reason"),
                    "stop_reason": part.get("stop_reason"),
                }
            )
        usage = chunk.get("usage")
        out = {
            "id": chunk.get("request_id"),
            "object": "chat.completion.chunk",
            "created": int(time.time()),
            "model": chunk.get("model"),
            "choices": choices,
            "usage": usage,
        }
        return {"chunk": out, "stream_state": state}

    async def derender_completion(self, request: web.Request) -> web.Response:
        if self._injected("derender"):
            return error(500, "derender failed (injected)")
        try:
            body = await self._body(request)
            if body.get("stream"):
                self.calls["derender_chunk"] += 1
                chunk = body["generate_chunk"]
                state = dict(body.get("stream_state") or {"ids": [], "text": 0})
                choices = []
                for part in chunk.get("choices") or ():
                    state["ids"] = [*state["ids"], *(part.get("token_ids") or ())]
                    text = self._text(state["ids"])
                    choices.append(
                        {
                            "index": part.get("index", 0),
                            "text": text[state["text"] :],
                            "logprobs": None,
                            "finish_reason": part.get("finish_reason"),
                            "stop_reason": part.get("stop_reason"),
                        }
                    )
                    state["text"] = len(text)
                out = {
                    "id": chunk.get("request_id"),
                    "object": "text_completion",
                    "created": int(time.time()),
                    "model": chunk.get("model"),
                    "choices": choices,
                    "usage": chunk.get("usage"),
                }
                return ok({"chunk": out, "stream_state": state})
            self.calls["derender"] += 1
            responses = body["generate_responses"]
            prompt_tokens = body.get("prompt_tokens") or [0]
            choices = [
                {
                    "index": choice.get("index", 0),
                    "text": self._text(choice["token_ids"]),
                    "logprobs": None,
                    "finish_reason": choice.get("finish_reason"),
                    "stop_reason": choice.get("stop_reason"),
                }
                for response in responses
                for choice in response["choices"]
            ]
            completion = sum(len(c["token_ids"]) for r in responses for c in r["choices"])
            first = responses[0]
            answer = {
                "id": first.get("request_id"),
                "object": "text_completion",
                "created": first.get("created") or int(time.time()),
                "model": first.get("model"),
                "choices": choices,
                "usage": self._usage(int(sum(prompt_tokens)), completion),
                "kv_transfer_params": first.get("kv_transfer_params"),
            }
        except (_BadRequest, KeyError, TypeError, ValueError, IndexError) as exc:
            return error(400, f"bad derender request: {exc}")
        return ok(answer)

    # -- the rest ----------------------------------------------------------------------------

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(status=200)

    async def models(self, request: web.Request) -> web.Response:
        name = self.config.served_model_name
        card: dict[str, Any] = {"id": name, "object": "model", "owned_by": "vllm"}
        card["max_model_len"] = self.config.max_model_len
        return ok({"object": "list", "data": [card]})

    async def tokenize(self, request: web.Request) -> web.Response:
        try:
            body = await self._body(request)
            prompt = body.get("prompt")
            if not isinstance(prompt, str):
                raise _BadRequest("prompt must be a string")
        except _BadRequest as exc:
            return error(400, str(exc))
        tokens = self.template.encode(prompt)
        return ok({"count": len(tokens), "tokens": tokens, "token_strs": None})

    async def set_faults(self, request: web.Request) -> web.Response:
        try:
            body = await self._body(request)
            current = msgspec.structs.asdict(self.faults)
            current.update(body)
            self.faults = msgspec.convert(current, _Faults)
        except (_BadRequest, msgspec.ValidationError) as exc:
            return error(400, str(exc))
        return ok({"faults": msgspec.structs.asdict(self.faults)})
