"""A router subprocess in front of in-process simulated engines, plus a reference engine."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from carryover.bench.sim.render_server import RenderSimConfig, SimRenderServer
from carryover.bench.sim.server import SimServer
from carryover.bench.sim.warm_tier import SimWarmTier
from tests.support.metrics import ascrape, assert_ledger_balanced, parse
from tests.support.ports import free_port
from tests.support.router_proc import RouterProcess
from tests.support.secrets import scan_error_body
from tests.support.sims import MODEL, qwen3, running, sim_config


@dataclass
class Stack:
    prefill: list[SimServer]
    decode: list[SimServer]
    reference: SimServer
    routers: list[RouterProcess]
    client: httpx.AsyncClient
    log_dir: Path
    render: SimRenderServer | None = None  # tokens-only engines: their render server

    @property
    def router(self) -> RouterProcess:
        return self.routers[0]


def router_args(prefill: list[SimServer], decode: list[SimServer], *extra: str) -> list[str]:
    args: list[str] = []
    for p in prefill:
        args += ["--prefill", p.url]
    for d in decode:
        args += ["--decode", d.url]
    for sim in (*prefill, *decode):
        events = sim.config.kv_events
        if events is not None:  # the sims bind loopback endpoints: the router connects there
            args += ["--kv-events", f"{sim.url}={events.endpoint}"]
            if events.replay_endpoint is not None:
                args += ["--kv-events-replay", f"{sim.url}={events.replay_endpoint}"]
    return [*args, "--health-interval", "0.2", *extra]


@asynccontextmanager
async def stack(
    log_dir: Path,
    *,
    prefills: int = 1,
    decodes: int = 1,
    routers: int = 1,
    router_flags: tuple[str, ...] = (),
    sim: dict[str, Any] | None = None,
    p_sim: dict[str, Any] | None = None,
    d_sim: dict[str, Any] | None = None,
    tokens: bool = False,
    reasoning_parser: str | None = None,
    warm_tier: SimWarmTier | None = None,
) -> AsyncIterator[Stack]:
    """``tokens``: P and D are ``--tokens-only`` engines and a simulated render server (with
    ``reasoning_parser``) renders and derenders; the reference engine serves the OpenAI API."""
    common = sim or {}
    engine_sim = {**common, "tokens_only": True} if tokens else common
    async with AsyncExitStack() as exits:
        render: SimRenderServer | None = None
        if tokens:
            render = SimRenderServer(
                RenderSimConfig(
                    served_model_name=MODEL,
                    port=free_port(),
                    max_model_len=common.get("max_model_len", 32768),
                    reasoning_parser=reasoning_parser,
                ),
                qwen3(),
            )
            await render.start()
            exits.push_async_callback(render.stop)
            router_flags = ("--engine-api", "tokens", "--render", render.url, *router_flags)
            if reasoning_parser is not None:
                router_flags = (*router_flags, "--reasoning-parser", reasoning_parser)
        p_list = [
            await exits.enter_async_context(
                running(sim_config("kv_producer", **{**engine_sim, **(p_sim or {})}))
            )
            for _ in range(prefills)
        ]
        d_list = [
            await exits.enter_async_context(
                running(sim_config("kv_consumer", **{**engine_sim, **(d_sim or {})}))
            )
            for _ in range(decodes)
        ]
        if warm_tier is not None:  # every P reaches it, as every engine reaches LMCache's server
            for p in p_list:
                p.engine.warm_tier = warm_tier
        reference = await exits.enter_async_context(running(sim_config(None, **common)))
        procs = [
            RouterProcess(router_args(p_list, d_list, *router_flags), log_dir)
            for _ in range(routers)
        ]
        for proc in procs:
            # In a thread: the router's shutdown talks to the simulated engines on this loop.
            exits.push_async_callback(asyncio.to_thread, proc.stop)
            await proc.start()
        client = await exits.enter_async_context(
            httpx.AsyncClient(timeout=30, event_hooks={"response": [scan_error_body]})
        )
        built = Stack(p_list, d_list, reference, procs, client, log_dir, render)
        yield built
        # The router's books: every handle it held reached one final state.
        for router in built.routers:
            if router.process is not None and router.process.poll() is None:
                await assert_ledger_balanced(built.client, router.url)
        # Used once, by D's own count: no block was read after D let it go (a handle used
        # twice, or after its release or expiry, is read this way), whatever the router said.
        # The engines may have been replaced by the test: those in the stack at the end count.
        for d in built.decode:
            assert reads_after_release(d) == 0, f"{d.url} served reads of released blocks"


def reads_after_release(d: SimServer) -> float:
    """Reads of blocks that D no longer held, by its own counter, read in process (a D that
    is down still counts)."""
    values = parse(d.engine.metrics.render().decode())
    return values.get("vllm:nixl_num_notifications_after_expiry_total", 0.0)


@dataclass
class TurnResult:
    status: int
    path: str | None
    content: str
    token_ids: list[int]
    body: dict[str, Any]
    chunks: list[Any] = field(default_factory=list)
    raw: str = ""

    @property
    def usage(self) -> dict[str, Any]:
        """The answer's usage (a stream's comes in its last chunk, with ``include_usage``)."""
        if not self.chunks:
            return dict(self.body.get("usage") or {})
        found = [c["usage"] for c in self.chunks if isinstance(c, dict) and c.get("usage")]
        return dict(found[-1]) if found else {}


async def chat_turn(
    client: httpx.AsyncClient,
    url: str,
    messages: list[dict[str, Any]],
    *,
    stream: bool = False,
    conversation_id: str | None = None,
    header_id: str | None = None,
    max_tokens: int = 40,
    api_key: str | None = None,
    **extra: Any,
) -> TurnResult:
    body: dict[str, Any] = {
        "model": MODEL,
        "messages": messages,
        "max_tokens": max_tokens,
        "stream": stream,
        **extra,
    }
    if conversation_id is not None:
        body["conversation_id"] = conversation_id
    headers = {"X-Conversation-ID": header_id} if header_id else {}
    if api_key is not None:
        headers["Authorization"] = f"Bearer {api_key}"
    return await _send(client, f"{url}/v1/chat/completions", body, headers, chat=True)


async def completion_turn(
    client: httpx.AsyncClient,
    url: str,
    prompt: Any,
    *,
    stream: bool = False,
    conversation_id: str | None = None,
    max_tokens: int = 40,
    **extra: Any,
) -> TurnResult:
    body: dict[str, Any] = {
        "model": MODEL,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "stream": stream,
        **extra,
    }
    if conversation_id is not None:
        body["conversation_id"] = conversation_id
    return await _send(client, f"{url}/v1/completions", body, {}, chat=False)


async def _send(
    client: httpx.AsyncClient,
    url: str,
    body: dict[str, Any],
    headers: dict[str, str],
    *,
    chat: bool,
) -> TurnResult:
    if not body.get("stream"):
        r = await client.post(url, json=body, headers=headers)
        data = r.json()
        if r.status_code != 200:
            return TurnResult(
                r.status_code, r.headers.get("x-carryover-path"), "", [], data, raw=r.text
            )
        choice = data["choices"][0]
        content = choice["message"]["content"] if chat else choice["text"]
        return TurnResult(
            200,
            r.headers.get("x-carryover-path"),
            content,
            choice.get("token_ids") or [],
            data,
            raw=r.text,
        )
    chunks: list[Any] = []
    content = ""
    ids: list[int] = []
    raw = ""
    async with client.stream("POST", url, json=body, headers=headers) as r:
        if r.status_code != 200:
            text = (await r.aread()).decode()
            return TurnResult(
                r.status_code, r.headers.get("x-carryover-path"), "", [], json.loads(text), raw=text
            )
        async for line in r.aiter_lines():
            raw += line + "\n"
            if not line.startswith("data: "):
                continue
            payload = line[6:]
            if payload == "[DONE]":
                chunks.append(payload)
                continue
            obj = json.loads(payload)
            chunks.append(obj)
            for choice in obj.get("choices", []):
                if chat:
                    content += choice.get("delta", {}).get("content") or ""
                else:
                    content += choice.get("text") or ""
                ids += choice.get("token_ids") or []
        path = r.headers.get("x-carryover-path")
    return TurnResult(200, path, content, ids, {}, chunks, raw)


async def reference_chat(
    stack: Stack, messages: list[dict[str, Any]], max_tokens: int = 40, **extra: Any
) -> TurnResult:
    return await chat_turn(
        stack.client, stack.reference.url, messages, max_tokens=max_tokens, **extra
    )


async def p_pulled(stack: Stack) -> float:
    """Tokens every P pulled from D so far (vLLM's own counter)."""
    total = 0.0
    for p in stack.prefill:
        values = await ascrape(stack.client, p.url)
        total += values.get("vllm:prompt_tokens_by_source_total{source=external_kv_transfer}", 0.0)
    return total


async def first_turn(
    s: Stack, first: str, second: str, *, router: int = 0
) -> tuple[str, list[dict[str, Any]]]:
    """A new conversation's first turn (cold) through ``router``; returns its id and the
    history for the second turn: the first message, the answer, then ``second``."""
    conversation = uuid.uuid4().hex
    messages: list[dict[str, Any]] = [{"role": "user", "content": first}]
    got = await chat_turn(s.client, s.routers[router].url, messages, conversation_id=conversation)
    assert got.status == 200 and got.path == "cold-miss", got.raw
    messages += [
        {"role": "assistant", "content": got.content},
        {"role": "user", "content": second},
    ]
    return conversation, messages


async def held_by(s: Stack, index: int = 0) -> list[str]:
    """The request ids whose blocks decode instance ``index`` holds pinned (the simulator's
    own state)."""
    state = (await s.client.get(s.decode[index].url + "/sim/state")).json()
    return list(state["held_requests"])


async def alternating_conversations(s: Stack, count: int, turns: int, text: str) -> int:
    """``count`` conversations of ``turns`` streamed turns, each turn on the next router
    (``text`` formatted with the turn's number, three times, is the user message); returns
    the turns sent."""
    for c in range(count):
        conversation = uuid.uuid4().hex
        messages: list[dict[str, Any]] = []
        for turn in range(turns):
            messages.append({"role": "user", "content": text.format(i=turn) * 3})
            router = s.routers[(c + turn) % len(s.routers)]
            got = await chat_turn(
                s.client, router.url, messages, stream=True, conversation_id=conversation
            )
            assert got.status == 200, got.raw
            messages.append({"role": "assistant", "content": got.content})
    return count * turns
