"""CPU per store call: the same claim-shaped ``EVALSHA`` through redis-py's asyncio client (a
blocking pool, as the store used it) and through the store's pipelined channel
(``state/resp.py``), one after the other against one loopback redis-server, on uvloop.

    python -m carryover.bench.store_calls [--calls 5000] [--concurrency 1,64] [--rounds 2]

Reports the client process's CPU µs per call (``time.process_time``) and wall µs per call; the
server's own CPU is not counted. The rounds alternate the two clients.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from collections.abc import Awaitable, Callable

import uvloop
from redis.asyncio import BlockingConnectionPool, Redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from carryover.bench.local_redis import local_redis
from carryover.state.resp import Address, RespChannel, Script

# The claim's shape: get and delete one key, report what was there.
_SCRIPT = "local v = redis.call('GET', KEYS[1]) if v then redis.call('DEL', KEYS[1]) end return v"

Call = Callable[[int], Awaitable[object]]


async def _measure(call: Call, calls: int, concurrency: int) -> tuple[float, float]:
    await call(-1)  # connect and load the script outside the measurement
    per_worker = calls // concurrency

    async def worker(w: int) -> None:
        for i in range(per_worker):
            async with asyncio.timeout(5):
                await call(w * per_worker + i)

    cpu, wall = time.process_time(), time.perf_counter()
    await asyncio.gather(*(worker(w) for w in range(concurrency)))
    done = per_worker * concurrency
    return (
        (time.process_time() - cpu) / done * 1e6,
        (time.perf_counter() - wall) / done * 1e6,
    )


async def _redis_py(url: str, calls: int, concurrency: int) -> tuple[float, float]:
    pool = BlockingConnectionPool.from_url(
        url, max_connections=256, timeout=1, retry=Retry(NoBackoff(), 0)
    )
    client = Redis.from_pool(pool)
    script = client.register_script(_SCRIPT)
    try:
        return await _measure(
            lambda i: script(keys=[f"bench:{i}"], args=["carryover-held"]), calls, concurrency
        )
    finally:
        await client.aclose()


async def _channel(url: str, calls: int, concurrency: int) -> tuple[float, float]:
    channel = RespChannel(Address.from_url(url))
    script = Script(_SCRIPT)
    try:
        return await _measure(
            lambda i: channel.evalsha(script, [f"bench:{i}"], ["carryover-held"]),
            calls,
            concurrency,
        )
    finally:
        channel.close()


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m carryover.bench.store_calls")
    parser.add_argument("--calls", type=int, default=5000)
    parser.add_argument("--concurrency", default="1,64")
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    levels = [int(c) for c in args.concurrency.split(",")]
    clients = {"redis-py": _redis_py, "pipelined channel": _channel}
    results: dict[tuple[str, int], list[tuple[float, float]]] = {}
    with local_redis() as url:
        for _ in range(args.rounds):
            for name, run in clients.items():
                for level in levels:
                    measured = uvloop.run(run(url, args.calls, level))
                    results.setdefault((name, level), []).append(measured)
    print("| client | concurrency | CPU µs / call (median) | wall µs / call (median) |")
    print("|---|---|---|---|")
    for (name, level), runs in results.items():
        cpu = statistics.median(r[0] for r in runs)
        wall = statistics.median(r[1] for r in runs)
        print(f"| {name} | {level} | {cpu:.1f} | {wall:.1f} |")


if __name__ == "__main__":
    main()
