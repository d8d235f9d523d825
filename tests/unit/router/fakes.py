"""Fake P and D engines on the router's transport seam: in process, no sockets, no sleeps.

They speak the part of vLLM's HTTP surface the router uses, with the semantics that matter to
a turn: P answers a one-token request with P-node params (pulling from D when given a live D
handle, freeing it when given ``remote_num_tokens: 0``); D answers with the prompt ids it ran,
its output ids and a fresh single-use handle. Every request is recorded; faults are set per
engine. Text becomes ids one character at a time, so a history's ids extend the last turn's.
"""

from __future__ import annotations

import asyncio
import itertools
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Protocol

import httpx

MODEL = "fake-model"
ANSWER = "fine, thanks"


def encode(text: str) -> list[int]:
    return [ord(c) for c in text]


def render(messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> list[int]:
    text = "".join(f"<{m['role']}>{m.get('content') or ''}</>" for m in messages)
    return encode(text + ("<assistant>" if add_generation_prompt else ""))


@dataclass
class Handle:
    tokens: int
    used: bool = False


@dataclass
class FakeEngine:
    role: str  # "prefill" | "decode" | "render" (vLLM's render server, tokens-only models)
    host: str
    requests: list[dict[str, Any]] = field(default_factory=list)
    # Statuses for the next requests (0: that one is served).
    fail_next: list[int] = field(default_factory=list)
    hang: asyncio.Event | None = None  # generation waits until it is set
    # The next N generation requests never connect: the connect deadline fires (the request
    # is not sent).
    connect_timeouts: int = 0
    holds: dict[str, Handle] = field(default_factory=dict)  # D: pinned handles
    reads: list[str] = field(default_factory=list)  # P: handles it pulled
    releases: list[str] = field(default_factory=list)  # P: handles it released
    answer: str = ANSWER  # D: what it generates
    break_after_handle: bool = False  # D: streams break after the chunk with the handle
    # P: runs its own rendering (a leading BOS) instead of the ids it was given, as an engine
    # that ignores forwarded ids would
    own_ids: bool = False
    kv_usage: float = 0.0  # what its /metrics reports as vllm:kv_cache_usage_perc
    kv_blocks: int | None = None  # vllm:cache_config_info's num_gpu_blocks (None: not shown)

    @property
    def url(self) -> str:
        return f"http://{self.host}"


class Tokenizer(Protocol):
    def __call__(self, body: dict[str, Any]) -> list[int]: ...


def fake_tokenize(body: dict[str, Any]) -> list[int]:
    if "messages" in body:
        return render(body["messages"], bool(body.get("add_generation_prompt", True)))
    return encode(body["prompt"])


class FakeFleet(httpx.AsyncBaseTransport):
    """Routes each request to the engine named by its host. ``tokenize`` is what every
    engine's ``/tokenize`` answers; ``start_time`` is the engines' process start time."""

    def __init__(self, *engines: FakeEngine, tokenize: Tokenizer = fake_tokenize) -> None:
        self.engines = {e.host: e for e in engines}
        self._ids = itertools.count(1)
        self.tokenize = tokenize
        self.tokenize_calls = 0
        self.start_time = 1.0

    def decode_of(self, handle: dict[str, Any]) -> FakeEngine:
        return self.engines[str(handle["remote_host"])]

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        engine = self.engines.get(request.url.netloc.decode())
        if engine is None:
            raise httpx.ConnectError("connection refused", request=request)
        path = request.url.path
        if request.method == "GET":
            return self._get(engine, path)
        if engine.connect_timeouts and path != "/tokenize":
            engine.connect_timeouts -= 1
            raise httpx.ConnectTimeout(f"connection timeout to {request.url}", request=request)
        body = json.loads(await request.aread())
        if engine.role == "render":
            engine.requests.append({"path": path, **body})
            return _render_server(path, body)
        if path == "/tokenize":
            self.tokenize_calls += 1
            try:
                return httpx.Response(200, json={"tokens": self.tokenize(body)})
            except ValueError as exc:  # what the engine's template cannot render
                return httpx.Response(400, json={"error": {"message": str(exc), "code": 400}})
        engine.requests.append(body)
        if engine.fail_next and (status := engine.fail_next.pop(0)):
            return httpx.Response(status, json={"error": {"message": "injected", "code": status}})
        if engine.hang is not None:
            await engine.hang.wait()
        if path == "/inference/v1/generate":
            if engine.role == "prefill":
                return self._prefill(engine, {**body, "prompt": body["token_ids"]})
            return self._generate(engine, body)
        if engine.role == "prefill":
            return self._prefill(engine, body)
        return self._decode(engine, body, chat=path.endswith("chat/completions"))

    def _get(self, engine: FakeEngine, path: str) -> httpx.Response:
        if path == "/metrics":
            return httpx.Response(
                200,
                text=f"process_start_time_seconds {self.start_time}\n"
                f"vllm:kv_cache_usage_perc {engine.kv_usage}\n"
                + (
                    f'vllm:cache_config_info{{block_size="16",num_gpu_blocks="{engine.kv_blocks}"}}'
                    " 1.0\n"
                    if engine.kv_blocks is not None
                    else ""
                ),
            )
        if path == "/version":
            return httpx.Response(200, json={"version": "0.33.0"})
        if path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": MODEL}]})
        return httpx.Response(200, json={})

    def _prefill(self, engine: FakeEngine, body: dict[str, Any]) -> httpx.Response:
        kv = body.get("kv_transfer_params") or {}
        prompt = kv.get("prompt_token_ids") or body.get("prompt")
        if kv.get("do_remote_decode") and kv.get("remote_block_ids"):
            holder = self.decode_of(kv)
            handle = holder.holds.get(kv["remote_request_id"])
            if kv.get("remote_num_tokens", 0) == 0:
                engine.releases.append(kv["remote_request_id"])
                holder.holds.pop(kv["remote_request_id"], None)
            elif handle is None or handle.used:
                return httpx.Response(500, json={"error": {"message": "Internal server error"}})
            else:
                handle.used = True
                holder.holds.pop(kv["remote_request_id"])
                engine.reads.append(kv["remote_request_id"])
        params = {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_engine_id": engine.host,
            "remote_request_id": f"p-{next(self._ids)}",
            "remote_host": engine.host,
            "remote_port": 1,
            "remote_block_ids": [[0]],
            "remote_num_tokens": len(prompt or []),
        }
        answer: dict[str, Any] = {"choices": [{"index": 0}], "kv_transfer_params": params}
        if body.get("return_token_ids"):
            answer["prompt_token_ids"] = [0, *(prompt or [])] if engine.own_ids else prompt
        return httpx.Response(200, json=answer)

    def _decode(
        self, engine: FakeEngine, body: dict[str, Any], *, chat: bool, max_tokens: int | None = None
    ) -> httpx.Response:
        kv = body.get("kv_transfer_params") or {}
        prompt = kv.get("prompt_token_ids") or body.get("prompt")
        if not isinstance(prompt, list):
            prompt = render(body["messages"]) if chat else encode(str(prompt))
        output = encode(engine.answer)[:max_tokens]
        request_id = f"d-{next(self._ids)}"
        tokens = len(prompt) + len(output) - 1
        engine.holds[request_id] = Handle(tokens)
        handle = {
            "do_remote_prefill": False,
            "do_remote_decode": True,
            "remote_engine_id": engine.host,
            "remote_request_id": request_id,
            "remote_host": engine.host,
            "remote_port": 1,
            "remote_block_ids": [list(range(-(-tokens // 16)))],
            "remote_num_tokens": tokens,
        }
        choice: dict[str, Any] = {"index": 0, "finish_reason": "stop", "token_ids": output}
        if chat:
            choice["message"] = {"role": "assistant", "content": ANSWER}
        else:
            choice["text"] = ANSWER
        if not body.get("stream"):
            answer = {"choices": [choice], "prompt_token_ids": prompt, "kv_transfer_params": handle}
            return httpx.Response(200, json=answer)
        return httpx.Response(
            200,
            headers={"content-type": "text/event-stream"},
            stream=_SSE(
                [
                    {
                        "choices": [{"index": 0, "delta": {"content": ""}}],
                        "prompt_token_ids": prompt,
                    },
                    {
                        "choices": [{**choice, "delta": {"content": ANSWER}}],
                        "kv_transfer_params": handle,
                    },
                ],
                broken=engine.break_after_handle,
            ),
        )

    def _generate(self, engine: FakeEngine, body: dict[str, Any]) -> httpx.Response:
        """D's /inference/v1/generate: tokens only; a handle on whole answers alone."""
        decoded = json.loads(
            self._decode(
                engine,
                {"kv_transfer_params": {**body["kv_transfer_params"]}, "prompt": body["token_ids"]},
                chat=False,
                max_tokens=(body.get("sampling_params") or {}).get("max_tokens"),
            ).content
        )
        choice = {
            "index": 0,
            "finish_reason": "stop",
            "token_ids": decoded["choices"][0]["token_ids"],
        }
        answer = {
            "request_id": "generate-tokens-x1",
            "prompt_token_ids": body["token_ids"],
            "choices": [choice],
        }
        if not body.get("stream"):
            return httpx.Response(
                200, json={**answer, "kv_transfer_params": decoded["kv_transfer_params"]}
            )
        # The handle D pinned is never reported on a stream (vLLM's generate has no field).
        ids = choice["token_ids"]
        events = [
            {
                "request_id": "generate-tokens-x1",
                "choices": [
                    {
                        "index": 0,
                        "token_ids": ids[i : i + 1],
                        "finish_reason": "stop" if i == len(ids) - 1 else None,
                    }
                ],
                **({"prompt_token_ids": body["token_ids"]} if i == 0 else {}),
            }
            for i in range(len(ids))
        ]
        return httpx.Response(
            200, headers={"content-type": "text/event-stream"}, stream=_SSE(events)
        )


def decode_ids(ids: list[int]) -> str:
    return "".join(chr(i) for i in ids)


def _render_server(path: str, body: dict[str, Any]) -> httpx.Response:
    """vLLM's render server, without parsers, for the fake ids."""
    if path == "/tokenize":
        return httpx.Response(200, json={"tokens": encode(body["prompt"])})
    if path == "/v1/chat/completions/render":
        sampling: dict[str, Any] = {"temperature": body.get("temperature", 1.0)}
        if body.get("max_tokens") not in (None, 16):  # vLLM leaves out SamplingParams' defaults
            sampling["max_tokens"] = body["max_tokens"]
        if body.get("stop"):
            sampling["stop"] = body["stop"]
        return httpx.Response(
            200,
            json={
                "request_id": "chatcmpl-r",
                "token_ids": render(body["messages"]),
                "sampling_params": sampling,
            },
        )
    if path == "/v1/chat/completions/derender" and not body["stream"]:
        generated = body["generate_response"]
        choice = generated["choices"][0]
        message = {"role": "assistant", "content": decode_ids(choice["token_ids"])}
        answer = {
            "id": generated["request_id"],
            "object": "chat.completion",
            "choices": [{"index": 0, "message": message, "finish_reason": choice["finish_reason"]}],
            "kv_transfer_params": generated.get("kv_transfer_params"),
        }
        return httpx.Response(200, json=answer)
    if path == "/v1/chat/completions/derender":
        chunk, state = body["generate_chunk"], body["stream_state"] or {"calls": 0}
        choices = [
            {
                "index": c["index"],
                "delta": {"content": decode_ids(c["token_ids"]) or None},
                "finish_reason": c.get("finish_reason"),
            }
            for c in chunk["choices"]
        ]
        out = {"id": chunk["request_id"], "object": "chat.completion.chunk", "choices": choices}
        out["usage"] = chunk.get("usage")
        return httpx.Response(
            200, json={"chunk": out, "stream_state": {"calls": state["calls"] + 1}}
        )
    return httpx.Response(404, json={"error": {"message": f"no {path}", "code": 404}})


class _SSE(httpx.AsyncByteStream):
    def __init__(self, events: list[dict[str, Any]], *, broken: bool = False) -> None:
        self._events = events
        self._broken = broken  # the connection drops where [DONE] would come

    async def __aiter__(self) -> AsyncIterator[bytes]:
        for event in self._events:
            yield f"data: {json.dumps(event)}\n\n".encode()
        if self._broken:
            raise httpx.ReadError("connection reset by peer")
        yield b"data: [DONE]\n\n"


def assert_ledger_balanced(app: Any) -> None:
    """After the app shut down (its background releases done): every handle it held has
    exactly one final state (router/handles/ledger.py)."""
    services = app.state.services
    assert services.runner.ledger.open == 0
    assert services.metrics.ledger_errors._value.get() == 0
