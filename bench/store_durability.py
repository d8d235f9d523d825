"""What a turn's store work costs on each Redis deployment, and what ``WAIT`` adds.

One "turn" is the router's two store calls: a claim (a miss or a hit) and a commit, through
:class:`~state.redis_store.RedisStore` on uvloop, against real servers on loopback: one
server; a primary and replica behind three Sentinels, with and without ``WAIT 1``; a
3-primary/3-replica Cluster, with and without ``WAIT 1``.

    python -m carryover.bench.store_durability [--turns 3000] [--concurrency 1,32] [--rounds 3]

Prints the client's wall and CPU µs per turn (medians over the rounds) and each arm's ratio to
the single server measured in the same run. The servers, the client and every replica share
this machine's cores.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
import uuid
from contextlib import ExitStack
from pathlib import Path

import uvloop

from carryover.bench.redis_server import RedisServer
from carryover.bench.redis_topologies import RedisCluster, RedisSentinels
from carryover.state import ConversationKey, Durability, HashedTokens, Record, RedisStore

ARMS = (
    ("single server", "single", Durability.NONE),
    ("sentinel, no wait", "sentinel", Durability.NONE),
    ("sentinel, WAIT 1", "sentinel", Durability.REPLICA),
    ("cluster, no wait", "cluster", Durability.NONE),
    ("cluster, WAIT 1", "cluster", Durability.REPLICA),
)


def _record(turn: int) -> Record:
    now = time.time()
    return Record(
        turn=turn,
        handle={"do_remote_decode": True, "remote_block_ids": [[1, 2, 3]], "remote_num_tokens": 40},
        decode="d0",
        decode_epoch=0,
        block_size=16,
        prefix=HashedTokens(list(range(40)), 32).prefix(40, output_start=20),
        created_at=now,
        expires_at=now + 300,
    )


async def _turns(store: RedisStore, turns: int, concurrency: int) -> tuple[float, float]:
    record = _record(1)
    per_worker = turns // concurrency

    async def worker(w: int) -> None:
        for i in range(per_worker):
            key = ConversationKey("bench", "m", f"c{w}-{i % 50}")
            await store.claim(key)
            await store.commit(key, record, now=time.time())

    await worker(-1)  # connect, load the scripts, learn the slot map
    cpu, wall = time.process_time(), time.perf_counter()
    await asyncio.gather(*(worker(w) for w in range(concurrency)))
    done = per_worker * concurrency
    return (time.perf_counter() - wall) / done * 1e6, (time.process_time() - cpu) / done * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m carryover.bench.store_durability")
    parser.add_argument("--turns", type=int, default=3000)
    parser.add_argument("--concurrency", default="1,32")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    levels = [int(c) for c in args.concurrency.split(",")]
    with ExitStack() as stack:
        workdir = Path(stack.enter_context(tempfile.TemporaryDirectory()))
        single = RedisServer(workdir / "single")
        sentinels = RedisSentinels(workdir / "sentinel")
        cluster = RedisCluster(workdir / "cluster")
        for deployment, stop in ((single, single.kill), (sentinels, sentinels.stop)):
            deployment.start()
            stack.callback(stop)
        cluster.start()
        stack.callback(cluster.stop)
        urls = {"single": single.url, "sentinel": sentinels.url, "cluster": cluster.url}
        results: dict[tuple[str, int], list[tuple[float, float]]] = {}

        async def measure() -> None:
            for _ in range(args.rounds):
                for name, topology, durability in ARMS:
                    store = RedisStore.from_url(
                        urls[topology],
                        timeout=5.0,
                        namespace=f"b{uuid.uuid4().hex[:8]}",
                        durability=durability,
                    )
                    try:
                        for level in levels:
                            got = await _turns(store, args.turns, level)
                            results.setdefault((name, level), []).append(got)
                    finally:
                        await store.close()

        uvloop.run(measure())
    print("| deployment | concurrency | wall µs/turn | CPU µs/turn | wall vs single |")
    print("|---|---|---|---|---|")
    for level in levels:
        base = statistics.median(w for w, _ in results[("single server", level)])
        for name, _, _ in ARMS:
            wall = statistics.median(w for w, _ in results[(name, level)])
            cpu = statistics.median(c for _, c in results[(name, level)])
            print(f"| {name} | {level} | {wall:.0f} | {cpu:.0f} | {wall / base:.2f} |")


if __name__ == "__main__":
    main()
