"""The HTTP face of a simulated vLLM instance (aiohttp, so tests can run it in-process)."""

from __future__ import annotations

import asyncio
import functools
import os
import random
import secrets
import time
from typing import Any

import msgspec
from aiohttp import web

from carryover.bench.sim.chat import SimRenderError, SimTemplate
from carryover.bench.sim.config import SimConfig
from carryover.bench.sim.engine import EngineError, GenerationRequest, SimEngine
from carryover.bench.sim.generate_api import cache_salt, generate
from carryover.bench.sim.http import error, ok, serve
from carryover.bench.sim.responses import streamed_answer, whole_answer

__all__ = ["SimServer"]

_decode = msgspec.json.Decoder()


class _Faults(msgspec.Struct):
    error_rate: float = 0.0
    hang: bool = False
    slow: float = 0.0
    slow_probes: float = 0.0  # seconds added to /health
    fail_next: int = 0  # the next N generation requests answer 500
    drop_stream_after: int | None = None  # chunks, then the connection is cut
    # Run the prompt without its last id, whatever was sent: an engine that runs other ids
    # than the router checked (a field that truncates or re-renders, say).
    alter_prompt: bool = False
    # A request whose body holds this text answers 500: an input that fails the request
    # inside the engine, and only the requests that carry it.
    poison: str = ""


class SimServer:
    """One instance: engine + HTTP app. ``await start()`` / ``await stop()`` in a running loop."""

    def __init__(self, config: SimConfig, template: SimTemplate | None = None) -> None:
        self.config = config
        self.template = template or SimTemplate.qwen3()
        self.engine = SimEngine(config, self.template)
        self.faults = _Faults(error_rate=config.error_rate, hang=config.hang, slow=config.slow)
        self._hang_cleared = asyncio.Event()
        if not self.faults.hang:
            self._hang_cleared.set()
        self._rng = random.Random(config.seed)
        self._runner: web.AppRunner | None = None
        self.cache_salts: set[str] = set()  # every cache_salt a generation carried
        self.last_traceparent: str | None = None  # W3C trace context of the last generation
        self.generations_asked = 0  # generation requests received, refused ones included
        self.app = self._build_app()

    @property
    def url(self) -> str:
        return f"http://{self.config.host}:{self.config.port}"

    def _build_app(self) -> web.Application:
        app = web.Application(client_max_size=64 << 20)
        app.add_routes(
            [
                web.post("/v1/chat/completions", self.chat),
                web.post("/v1/completions", self.completions),
                web.post("/inference/v1/generate", functools.partial(generate, self)),
                web.post("/tokenize", self.tokenize),
                web.post("/detokenize", self.detokenize),
                web.post("/v1/chat/completions/render", self.render),
                web.get("/health", self.health),
                web.get("/v1/models", self.models),
                web.get("/version", self.version),
                web.get("/metrics", self.metrics),
                web.post("/reset_prefix_cache", self.reset_prefix_cache),
                web.post("/sim/faults", self.set_faults),
                web.get("/sim/state", self.state),
            ]
        )
        return app

    async def start(self) -> None:
        await self.engine.start()
        # A stop is a crash as far as clients can tell: in-flight requests are cut, not drained.
        self._runner = await serve(
            self.app, self.config.host, self.config.port, handler_cancellation=True
        )

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        await self.engine.stop()

    # -- helpers -----------------------------------------------------------------------------

    async def body_of(self, request: web.Request) -> dict[str, Any]:
        raw = await request.read()
        if self.faults.poison and self.faults.poison.encode() in raw:
            raise EngineError(500, "Internal server error (poisoned input)", "InternalServerError")
        try:
            body = _decode.decode(raw)
        except msgspec.DecodeError as exc:
            raise EngineError(400, f"invalid JSON body: {exc}") from exc
        if not isinstance(body, dict):
            raise EngineError(400, "the body must be a JSON object")
        return body

    def check_model(self, body: dict[str, Any]) -> str:
        model = body.get("model") or self.config.served_model_name
        if model != self.config.served_model_name:
            raise EngineError(404, f"The model `{model}` does not exist.", "NotFoundError")
        return str(model)

    def _prompt_ids_from_params(self, kv: dict[str, Any] | None) -> list[int] | None:
        """``kv_transfer_params.prompt_token_ids`` replaces rendering (docs/vllm-protocol.md §5)."""
        if not kv or "prompt_token_ids" not in kv:
            return None
        ids = kv.pop("prompt_token_ids")
        vocab = self.template.vocab_size
        if (
            not isinstance(ids, list)
            or not ids
            or not all(
                isinstance(i, int) and not isinstance(i, bool) and 0 <= i < vocab for i in ids
            )
        ):
            raise EngineError(400, "kv_transfer_params.prompt_token_ids must be valid token ids")
        return ids

    def _truncate(self, prompt: list[int], body: dict[str, Any]) -> list[int]:
        """``truncate_prompt_tokens`` as vLLM applies it when it tokenizes: keep the last k
        ids (``truncation_side: right`` keeps the first k); -1 means the model's length."""
        k = body.get("truncate_prompt_tokens")
        if k is None:
            return prompt
        if not isinstance(k, int) or isinstance(k, bool) or k < -1:
            raise EngineError(400, "truncate_prompt_tokens must be an integer >= -1")
        if k == -1:
            k = self.config.max_model_len
        if len(prompt) <= k:
            return prompt
        return prompt[:k] if body.get("truncation_side") == "right" else prompt[-k:]

    def _render_chat(self, body: dict[str, Any]) -> list[int]:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise EngineError(400, "messages must be a non-empty list")
        kwargs = body.get("chat_template_kwargs") or {}
        if not isinstance(kwargs, dict):
            raise EngineError(400, "chat_template_kwargs must be an object")
        try:
            return self.template.render(
                messages,
                add_generation_prompt=bool(body.get("add_generation_prompt", True)),
                tools=body.get("tools"),
                chat_template_kwargs=kwargs,
            )
        except SimRenderError as exc:  # what the simulator does not model
            raise EngineError(400, str(exc)) from exc

    def _sampling(self, body: dict[str, Any], prompt_len: int, *, chat: bool) -> dict[str, Any]:
        temperature = body.get("temperature")
        if temperature not in (None, 0, 0.0):
            raise EngineError(400, "the simulator is deterministic: temperature must be 0")
        if body.get("n", 1) != 1:
            raise EngineError(400, "n must be 1")
        max_tokens = body.get("max_completion_tokens") if chat else None
        if max_tokens is None:
            max_tokens = body.get("max_tokens")
        if max_tokens is None:
            max_tokens = self.config.max_model_len - prompt_len
        if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
            raise EngineError(400, "max_tokens must be a positive integer")
        stop = body.get("stop") or []
        if isinstance(stop, str):
            stop = [stop]
        if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
            raise EngineError(400, "stop must be a string or a list of strings")
        return {"max_tokens": max_tokens, "stop": stop, "ignore_eos": bool(body.get("ignore_eos"))}

    async def faults_before(self) -> web.Response | None:
        if self.faults.slow:
            await asyncio.sleep(self.faults.slow)
        if self.faults.hang:
            await self._hang_cleared.wait()  # until the fault is cleared, as a stall that ends
        if self.faults.fail_next > 0:
            self.faults.fail_next -= 1
            return error(500, "Internal server error (injected)", "InternalServerError")
        if self.faults.error_rate and self._rng.random() < self.faults.error_rate:
            return error(500, "Internal server error (injected)", "InternalServerError")
        return None

    # -- generation endpoints ----------------------------------------------------------------

    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=True)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=False)

    async def _generate(self, request: web.Request, *, chat: bool) -> web.StreamResponse:
        self.generations_asked += 1
        if self.config.tokens_only:
            return error(404, "Not Found: a --tokens-only server has no OpenAI generation")
        fault = await self.faults_before()
        if fault is not None:
            return fault
        try:
            body = await self.body_of(request)
            model = self.check_model(body)
            kv = body.get("kv_transfer_params")
            if kv is not None and not isinstance(kv, dict):
                raise EngineError(400, "kv_transfer_params must be an object")
            kv = dict(kv) if kv is not None else None
            prompt = self._prompt_ids_from_params(kv)
            if chat and body.get("echo"):
                prompt = None  # vLLM renders the messages under echo, forwarded ids or not
            forwarded = prompt is not None
            thinking = False
            if chat:
                kwargs = body.get("chat_template_kwargs") or {}
                thinking = isinstance(kwargs, dict) and kwargs.get("enable_thinking") is True
                if prompt is None:
                    prompt = await asyncio.to_thread(self._render_chat, body)
            elif prompt is None:
                prompt = self._completion_prompt(body.get("prompt"))
            if not forwarded:  # forwarded ids skip tokenization, and so truncation (vLLM 0.33)
                prompt = self._truncate(prompt, body)
            if self.faults.alter_prompt and len(prompt) > 1:
                prompt = prompt[:-1]
            sampling = self._sampling(body, len(prompt), chat=chat)
            salt = cache_salt(body)
            if salt is not None:
                self.cache_salts.add(salt)
        except EngineError as exc:
            return error(exc.status, str(exc), exc.kind)
        prefix = "chatcmpl" if chat else "cmpl"
        header_id = request.headers.get("X-Request-Id") or body.get("request_id")
        self.last_traceparent = request.headers.get("traceparent")
        response_id = f"{prefix}-{header_id or secrets.token_hex(8)}"
        gen = GenerationRequest(
            request_id=SimEngine.new_request_id(response_id),
            prompt=prompt,
            thinking=thinking,
            kv_params=kv,
            cache_salt=salt,
            **sampling,
        )
        meta = {
            "id": response_id,
            "created": int(time.time()),
            "model": model,
            "return_token_ids": bool(body.get("return_token_ids")),
            "chat": chat,
        }
        if body.get("stream"):
            options = body.get("stream_options") or {}
            include_usage = isinstance(options, dict) and bool(options.get("include_usage"))
            return await streamed_answer(
                request,
                self.engine,
                gen,
                meta,
                include_usage=include_usage,
                streams_handles=self.config.streams_handles,
                drop_after=lambda: self.faults.drop_stream_after,
                interval=self.config.stream_interval,
            )
        return await whole_answer(self.engine, gen, meta)

    def _completion_prompt(self, prompt: Any) -> list[int]:
        if isinstance(prompt, str) and prompt:
            return self.template.encode(prompt)
        if (
            isinstance(prompt, list)
            and prompt
            and all(isinstance(i, int) and not isinstance(i, bool) for i in prompt)
        ):
            if not all(0 <= i < self.template.vocab_size for i in prompt):
                raise EngineError(400, "prompt token ids out of vocabulary")
            return list(prompt)
        raise EngineError(400, "prompt must be a non-empty string or a list of token ids")

    # -- the rest of vLLM's surface ----------------------------------------------------------

    async def tokenize(self, request: web.Request) -> web.Response:
        try:
            body = await self.body_of(request)
            self.check_model(body)
            if "messages" in body:
                tokens = await asyncio.to_thread(self._render_chat, body)
            else:
                prompt = body.get("prompt")
                if not isinstance(prompt, str):
                    raise EngineError(400, "prompt must be a string")
                tokens = self.template.encode(prompt)
        except EngineError as exc:
            return error(exc.status, str(exc), exc.kind)
        return ok(
            {
                "count": len(tokens),
                "max_model_len": self.config.max_model_len,
                "tokens": tokens,
                "token_strs": None,
            }
        )

    async def detokenize(self, request: web.Request) -> web.Response:
        try:
            body = await self.body_of(request)
            tokens = body.get("tokens")
            if not isinstance(tokens, list) or not all(isinstance(t, int) for t in tokens):
                raise EngineError(400, "tokens must be a list of token ids")
        except EngineError as exc:
            return error(exc.status, str(exc), exc.kind)
        return ok({"prompt": self.template.decode(tokens, skip_special_tokens=False)})

    async def render(self, request: web.Request) -> web.Response:
        """``/v1/chat/completions/render`` of vLLM's render server: the prompt ids it runs."""
        try:
            body = await self.body_of(request)
            model = self.check_model(body)
            tokens = await asyncio.to_thread(self._render_chat, body)
        except EngineError as exc:
            return error(exc.status, str(exc), exc.kind)
        header_id = request.headers.get("X-Request-Id") or secrets.token_hex(8)
        return ok(
            {
                "request_id": f"chatcmpl-{header_id}",
                "token_ids": tokens,
                "sampling_params": {"max_tokens": body.get("max_tokens")},
                "model": model,
                "stream": bool(body.get("stream")),
                "kv_transfer_params": None,
            }
        )

    async def health(self, request: web.Request) -> web.Response:
        if self.faults.slow_probes:
            await asyncio.sleep(self.faults.slow_probes)  # an engine too busy to answer soon
        return web.Response(status=200)

    async def models(self, request: web.Request) -> web.Response:
        name = self.config.served_model_name
        return ok(
            {
                "object": "list",
                "data": [
                    {
                        "id": name,
                        "object": "model",
                        "created": 0,
                        "owned_by": "vllm",
                        "root": self.config.model,
                        "max_model_len": self.config.max_model_len,
                    }
                ],
            }
        )

    async def version(self, request: web.Request) -> web.Response:
        return ok({"version": self.config.vllm_version})

    async def metrics(self, request: web.Request) -> web.Response:
        self.engine.refresh_gauges()
        return web.Response(body=self.engine.metrics.render(), content_type="text/plain")

    async def state(self, request: web.Request) -> web.Response:
        """Simulator-only introspection for tests and reports."""
        engine = self.engine
        return ok(
            {
                "engine_id": engine.engine_id,
                "held_requests": engine.held_requests,
                "leases": engine.lease_seconds_left(),
                "renewing": engine.renewing_leases(),
                "used_blocks": engine.pool.used,
                "cached_blocks": engine.pool.cached_blocks,
                "num_blocks": engine.pool.num_blocks,
                "last_traceparent": self.last_traceparent,
                "cache_salts": sorted(self.cache_salts),
            }
        )

    async def reset_prefix_cache(self, request: web.Request) -> web.Response:
        """vLLM's (dev-mode) endpoint: forget every cached block (``AllBlocksCleared``)."""
        self.engine.pool.clear_cache()
        await self.engine.publish_kv_events()
        return web.Response(status=200)

    async def set_faults(self, request: web.Request) -> web.Response:
        """``{"kill"|"restart"|"evict_pinned": true}``, ``{"advance_clock": seconds}`` (moves
        this engine's clock forward: pins and leases expire as if that time had passed) and
        ``{"drop_kv_events": n}`` (the next n event batches miss the PUB socket, not the replay
        buffer) act once; the other fields stay set."""
        try:
            body = await self.body_of(request)
        except EngineError as exc:
            return error(exc.status, str(exc))
        if body.pop("kill", False):
            asyncio.get_running_loop().call_later(0.05, os._exit, 1)
            return ok({"killed": True})
        result: dict[str, Any] = {}
        if body.pop("restart", False):
            self.engine.restart()
            result["engine_id"] = self.engine.engine_id
        if body.pop("evict_pinned", False):
            result["evicted"] = self.engine.evict_held()
        drop = body.pop("drop_kv_events", None)
        if drop is not None:
            if self.engine.kv_events is None or not isinstance(drop, int) or drop < 0:
                return error(400, "drop_kv_events takes a count >= 0 on an engine with events")
            self.engine.kv_events.drop_next = drop
        advance = body.pop("advance_clock", None)
        if advance is not None:
            if not isinstance(advance, (int, float)) or isinstance(advance, bool) or advance < 0:
                return error(400, "advance_clock takes a number of seconds >= 0")
            self.engine.advance_clock(float(advance))
            result["clock"] = self.engine.now()
        try:
            current = msgspec.structs.asdict(self.faults)
            current.update(body)
            self.faults = msgspec.convert(current, _Faults)
        except msgspec.ValidationError as exc:
            return error(400, str(exc))
        if not self.faults.hang:
            self._hang_cleared.set()  # requests held by the hang go on
        elif self._hang_cleared.is_set():
            self._hang_cleared = asyncio.Event()
        result["faults"] = msgspec.structs.asdict(self.faults)
        return ok(result)
