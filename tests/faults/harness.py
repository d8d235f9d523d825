"""Two router processes sharing real Redis (one server, a Sentinel-watched primary and
replica, or a Cluster) in front of simulated engines, and a steady multi-turn load that
records what every request got."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from carryover.bench.redis_server import RedisServer
from carryover.bench.redis_topologies import RedisCluster, RedisSentinels
from carryover.bench.sim.render_server import RenderSimConfig, SimRenderServer
from carryover.bench.sim.server import SimServer
from tests.support.metrics import ascrape, ledger_open
from tests.support.ports import free_port
from tests.support.router_proc import RouterProcess
from tests.support.sims import MODEL, qwen3, sim_config
from tests.support.stack import chat_turn, reads_after_release
from tests.support.waiting import ConditionTimeout, eventually

TEXT = "[{cid} {turn}] Tell me about the rivers, stones and seasons of an old garden and its gardener. "


Deployment = RedisServer | RedisSentinels | RedisCluster


@dataclass
class Harness:
    deployment: Deployment
    prefill: list[SimServer]
    decode: list[SimServer]
    reference: SimServer
    render: SimServer | None
    routers: list[RouterProcess]
    client: httpx.AsyncClient
    dead_routers: set[int] = field(default_factory=set)
    tokens_render: SimRenderServer | None = None  # tokens-only engines' render server
    replaced_decodes: list[SimServer] = field(default_factory=list)  # a restart replaced them

    @property
    def redis(self) -> RedisServer:
        """The one server (the single-server cases)."""
        assert isinstance(self.deployment, RedisServer)
        return self.deployment

    @property
    def sentinels(self) -> RedisSentinels:
        assert isinstance(self.deployment, RedisSentinels)
        return self.deployment

    @property
    def cluster(self) -> RedisCluster:
        assert isinstance(self.deployment, RedisCluster)
        return self.deployment

    def router_url(self, turn: int) -> str:
        live = [i for i in range(len(self.routers)) if i not in self.dead_routers]
        return self.routers[live[turn % len(live)]].url

    async def replace(self, servers: list[SimServer], index: int) -> None:
        """Start a fresh engine on the same ports (a restart: new engine id, empty cache)."""
        server = SimServer(servers[index].config, qwen3())
        await server.start()
        if servers is self.decode:
            self.replaced_decodes.append(servers[index])
        servers[index] = server

    async def unsettled(self) -> int:
        """Handles the live routers hold without a final state once they are idle
        (router/handles/ledger.py): what they took less what ended, waited for while releases finish.
        A router killed by the fault took its books with it."""
        total = 0
        for index, router in enumerate(self.routers):
            if index in self.dead_routers:
                continue
            scrape = functools.partial(ascrape, self.client, router.url)
            with contextlib.suppress(ConditionTimeout):
                await eventually(
                    scrape, lambda v: ledger_open(v) == 0, what="handles settled", timeout=15
                )
            total += int(ledger_open(await scrape()))
        return total

    async def double_reads(self) -> int:
        """Reads of blocks a D no longer held, by every D's own count: read in process, so a
        D that is down, or was replaced by a restart, still counts."""
        return int(sum(reads_after_release(d) for d in [*self.decode, *self.replaced_decodes]))


async def _start(server: SimServer) -> SimServer:
    await server.start()
    return server


@asynccontextmanager
async def harness(
    tmp_path: Path,
    *,
    router_flags: tuple[str, ...] = (),
    d_sim: dict[str, Any] | None = None,
    p_sim: dict[str, Any] | None = None,
    with_render: bool = False,
    tokens: bool = False,
    topology: str = "single",
) -> AsyncIterator[Harness]:
    """``tokens``: ``--tokens-only`` P and D and a simulated render server
    (``engine_api = "tokens"``); the reference engine serves the OpenAI API. ``topology``:
    ``single``, ``sentinel`` or ``cluster``, started for this harness alone."""
    async with AsyncExitStack() as exits:
        redis: Deployment
        if topology == "sentinel":
            redis = RedisSentinels(tmp_path / "redis")
        elif topology == "cluster":
            redis = RedisCluster(tmp_path / "redis")
        else:
            redis = RedisServer(tmp_path / "redis")
        exits.callback(redis.stop if not isinstance(redis, RedisServer) else redis.kill)
        redis.start()
        common: dict[str, Any] = {"threshold": 16, "tokens_only": tokens}
        prefill = [
            await _start(SimServer(sim_config("kv_producer", **common, **(p_sim or {})), qwen3()))
            for _ in range(2)
        ]
        decode = [
            await _start(SimServer(sim_config("kv_consumer", **common, **(d_sim or {})), qwen3()))
            for _ in range(2)
        ]
        reference = await _start(SimServer(sim_config(None), qwen3()))
        tokens_render: SimRenderServer | None = None
        if tokens:
            tokens_render = SimRenderServer(
                RenderSimConfig(served_model_name=MODEL, port=free_port()), qwen3()
            )
            await tokens_render.start()
            exits.push_async_callback(tokens_render.stop)
        render = await _start(SimServer(sim_config(None), qwen3())) if with_render else None
        h_servers = [prefill, decode]

        async def stop_all() -> None:
            for group in h_servers:
                for server in group:
                    await server.stop()
            await reference.stop()
            if harness_obj.render is not None:
                await harness_obj.render.stop()

        args: list[str] = []
        for p in prefill:
            args += ["--prefill", p.url]
        for d in decode:
            args += ["--decode", d.url]
        if render is not None:
            args += ["--render", render.url]
        if tokens_render is not None:
            args += ["--engine-api", "tokens", "--render", tokens_render.url]
        args += [
            "--redis",
            redis.url,
            # Short, so that a frozen Redis costs little per turn; not so short that a loaded
            # machine's ordinary store calls miss it.
            "--store-timeout",
            "0.5",
            "--health-interval",
            "0.2",
            "--prefill-timeout",
            "1",
            "--first-byte-timeout",
            "5",
            *router_flags,
        ]
        routers = [RouterProcess(args, tmp_path) for _ in range(2)]
        client = await exits.enter_async_context(httpx.AsyncClient(timeout=30))
        harness_obj = Harness(
            redis, prefill, decode, reference, render, routers, client, tokens_render=tokens_render
        )
        exits.push_async_callback(stop_all)
        for router in routers:
            # In a thread: the router's shutdown talks to the simulated engines on this loop.
            exits.push_async_callback(asyncio.to_thread, router.stop)
            await router.start()
        yield harness_obj


@dataclass
class Outcome:
    sent: int = 0
    ok: int = 0
    failed: int = 0
    unclean: int = 0
    wrong: int = 0
    paths: Counter[str] = field(default_factory=Counter)
    reuse_at: list[float] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    #: status and seconds to the answer of every request that failed cleanly
    refusals: list[tuple[int, float]] = field(default_factory=list)

    def first_reuse_after(self, moment: float) -> float | None:
        later = [t for t in self.reuse_at if t >= moment]
        return min(later) - moment if later else None


async def _conversation(h: Harness, outcome: Outcome, stop: asyncio.Event, index: int) -> None:
    while not stop.is_set():
        cid = f"{index}-{uuid.uuid4().hex[:6]}"
        messages: list[dict[str, Any]] = []
        for turn in range(5):
            if stop.is_set():
                return
            messages.append({"role": "user", "content": TEXT.format(cid=cid, turn=turn) * 2})
            stream = turn % 2 == 1
            url = h.router_url(turn + index)
            outcome.sent += 1
            started = time.monotonic()
            try:
                async with asyncio.timeout(15):
                    got = await chat_turn(
                        h.client, url, messages, stream=stream, conversation_id=cid
                    )
            except TimeoutError:
                outcome.unclean += 1
                outcome.errors.append(f"hang on {url}")
                break
            except httpx.HTTPError as exc:
                router = next(i for i, r in enumerate(h.routers) if r.url == url)
                if router in h.dead_routers:
                    outcome.failed += 1  # the router process is gone: nothing could answer
                else:
                    outcome.unclean += 1
                    outcome.errors.append(f"{type(exc).__name__} from {url}")
                break
            if got.status != 200:
                if isinstance(got.body, dict) and "error" in got.body:
                    outcome.failed += 1
                    outcome.refusals.append((got.status, time.monotonic() - started))
                else:
                    outcome.unclean += 1
                break
            if stream:
                if not got.chunks or got.chunks[-1] != "[DONE]":
                    outcome.unclean += 1
                    outcome.errors.append("stream without [DONE]")
                    break
                if any(isinstance(c, dict) and "error" in c for c in got.chunks):
                    outcome.failed += 1
                    break
            outcome.ok += 1
            want = await chat_turn(h.client, h.reference.url, messages)
            if got.content != want.content:
                outcome.wrong += 1
                outcome.errors.append(f"wrong answer on {got.path}")
            outcome.paths[got.path or "?"] += 1
            if got.path in ("reuse", "partial"):
                outcome.reuse_at.append(time.monotonic())
            messages.append({"role": "assistant", "content": got.content})


@asynccontextmanager
async def steady_load(h: Harness, conversations: int = 4) -> AsyncIterator[Outcome]:
    outcome = Outcome()
    stop = asyncio.Event()
    tasks = [asyncio.create_task(_conversation(h, outcome, stop, i)) for i in range(conversations)]
    try:
        yield outcome
    finally:
        stop.set()
        await asyncio.gather(*tasks)
