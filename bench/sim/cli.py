"""``carryover sim MODEL --port N …``: one simulated vLLM instance in its own process."""

from __future__ import annotations

import asyncio
import logging
import signal
import sys
from collections.abc import Sequence

from bench.sim.config import parse_sim_args
from bench.sim.server import SimServer


async def _serve(argv: Sequence[str]) -> None:
    config = parse_sim_args(argv)
    server = SimServer(config)
    await server.start()
    print(
        f"carryover sim: {config.served_model_name} on {server.url} "
        f"(engine {server.engine.engine_id}, role {config.kv_transfer and config.kv_transfer.kv_role})",
        flush=True,
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await server.stop()


def main(argv: Sequence[str] | None = None) -> None:
    logging.basicConfig(
        level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s %(message)s"
    )
    try:
        import uvloop

        uvloop.install()
    except ImportError:  # pragma: no cover - uvloop is a dependency; plain asyncio also works
        pass
    asyncio.run(_serve(sys.argv[1:] if argv is None else argv))
