"""``carryover sim MODEL --port N …``: one simulated vLLM instance in its own process;
``carryover sim-render MODEL --port N [--reasoning-parser qwen3]``: a simulated render server
(``vllm launch render``) for ``--tokens-only`` simulated engines;
``carryover sim-warm-tier --port N [--chunk-tokens 256]``: a simulated warm KV tier (LMCache's
server) that simulated engines share with ``--sim-warm-tier URL``."""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
from collections.abc import Sequence

from carryover.bench.sim.config import parse_sim_args
from carryover.bench.sim.render_server import RenderSimConfig, SimRenderServer
from carryover.bench.sim.server import SimServer
from carryover.bench.sim.warm_tier import SimWarmTier


async def _serve(argv: Sequence[str]) -> None:
    config = parse_sim_args(argv)
    server = SimServer(config)
    await server.start()
    print(
        f"carryover sim: {config.served_model_name} on {server.url} "
        f"(engine {server.engine.engine_id}, role {config.kv_transfer and config.kv_transfer.kv_role})",
        flush=True,
    )
    await _until_stopped()
    await server.stop()


async def _serve_render(argv: Sequence[str]) -> None:
    p = argparse.ArgumentParser(prog="carryover sim-render", description=__doc__)
    p.add_argument("model")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8010)
    p.add_argument("--served-model-name")
    p.add_argument("--max-model-len", type=int, default=32768)
    p.add_argument("--reasoning-parser", choices=["qwen3"])
    args = p.parse_args(list(argv))
    server = SimRenderServer(
        RenderSimConfig(
            served_model_name=args.served_model_name or args.model,
            host=args.host,
            port=args.port,
            max_model_len=args.max_model_len,
            reasoning_parser=args.reasoning_parser,
        )
    )
    await server.start()
    print(f"carryover sim-render: {server.config.served_model_name} on {server.url}", flush=True)
    await _until_stopped()
    await server.stop()


async def _serve_warm_tier(argv: Sequence[str]) -> None:
    p = argparse.ArgumentParser(prog="carryover sim-warm-tier", description=__doc__)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8020)
    p.add_argument("--chunk-tokens", type=int, default=256)
    args = p.parse_args(list(argv))
    tier = SimWarmTier(chunk_tokens=args.chunk_tokens, host=args.host, port=args.port)
    await tier.start()
    print(f"carryover sim-warm-tier: {args.chunk_tokens}-token chunks on {tier.url}", flush=True)
    await _until_stopped()
    await tier.stop()


async def _until_stopped() -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()


def main(
    argv: Sequence[str] | None = None, *, render: bool = False, warm_tier: bool = False
) -> None:
    logging.basicConfig(
        level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s %(message)s"
    )
    try:
        import uvloop

        uvloop.install()
    except ImportError:  # pragma: no cover - uvloop is a dependency; plain asyncio also works
        pass
    serve = _serve_render if render else _serve_warm_tier if warm_tier else _serve
    asyncio.run(serve(sys.argv[1:] if argv is None else argv))
