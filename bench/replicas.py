"""Scale-out: the same multi-turn workload through 1, 2, 4 and 8 router processes.

Each turn of a conversation goes to the next router (turn t of conversation c to router
``(c + t) mod N``), as a load balancer without session affinity would send it: no router sees
two turns of one conversation in a row. Stores:

* ``redis``: every router shares one redis-server;
* ``cluster``: every router shares a 3-primary/3-replica Redis Cluster (``WAIT 1``);
* ``memory``: each router keeps its own in-process state (what a router without a shared
  index can do): a turn reuses only when the router that served the last turn serves it.

Per arm: the share of turns after the first that reused D's KV (``reuse`` or ``partial``), turns
per second over the arm's wall time, and turn-2+ TTFT median. Every arm runs on fresh simulated
engines (2 P, 2 D); routers, engines, Redis and the client share this machine's cores.

    carryover bench replicas [--routers 1,2,4,8] [--stores redis,cluster,memory]
"""

from __future__ import annotations

import asyncio
import statistics
import tempfile
import time
from collections.abc import Sequence
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx
import msgspec

from carryover.bench.procs import topology
from carryover.bench.redis_server import RedisServer
from carryover.bench.redis_topologies import RedisCluster
from carryover.bench.runner import TurnRecord, one_turn
from carryover.bench.workload import Conversation

__all__ = ["ReplicasRow", "run_replicas"]

STORES = ("redis", "cluster", "memory")


class ReplicasRow(msgspec.Struct):
    store: str
    routers: int
    turns: int
    errors: int
    reuse_share: float  # of turns after the first
    turns_per_second: float
    ttft_p50_ms: float  # turns after the first


async def _drive(
    urls: Sequence[str], conversations: list[Conversation], model: str
) -> list[TurnRecord]:
    limits = httpx.Limits(max_connections=1024, max_keepalive_connections=1024)
    records: list[TurnRecord] = []
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:

        async def converse(index: int, conversation: Conversation) -> None:
            await asyncio.sleep(conversation.start_after)
            messages: list[dict[str, Any]] = []
            if conversation.system:
                messages.append({"role": "system", "content": conversation.system})
            for turn, text in enumerate(conversation.users):
                messages.append({"role": "user", "content": text})
                url = urls[(index + turn) % len(urls)]
                record = await one_turn(
                    client, url, "replicas", conversation, turn, messages, model, True
                )
                records.append(record)
                if record.error is not None:
                    return
                messages.append({"role": "assistant", "content": record.answer})

        await asyncio.gather(*(converse(i, c) for i, c in enumerate(conversations)))
    return records


def _row(store: str, routers: int, records: list[TurnRecord], wall: float) -> ReplicasRow:
    later = [r for r in records if r.turn > 1 and r.error is None]
    reused = [r for r in later if r.path in ("reuse", "partial")]
    ttfts = [r.ttft for r in later if r.ttft is not None]
    return ReplicasRow(
        store,
        routers,
        len(records),
        sum(1 for r in records if r.error is not None),
        len(reused) / len(later) if later else 0.0,
        len(records) / wall if wall else 0.0,
        statistics.median(ttfts) * 1000 if ttfts else 0.0,
    )


def run_replicas(
    conversations: list[Conversation],
    out: Path,
    *,
    routers: Sequence[int] = (1, 2, 4, 8),
    stores: Sequence[str] = STORES,
    model: str = "sim-qwen3",
    speed: float = 1.0,
) -> list[ReplicasRow]:
    rows: list[ReplicasRow] = []
    for store in stores:
        if store not in STORES:
            raise ValueError(f"unknown store {store!r}: one of {', '.join(STORES)}")
        for count in routers:
            with ExitStack() as stack, topology() as topo:
                flags: list[str] = []
                workdir = Path(stack.enter_context(tempfile.TemporaryDirectory()))
                if store == "redis":
                    server = RedisServer(workdir / "redis")
                    server.start()
                    stack.callback(server.kill)
                    flags = ["--redis", server.url]
                elif store == "cluster":
                    cluster = RedisCluster(workdir / "cluster")
                    stack.callback(cluster.stop)
                    cluster.start()
                    flags = ["--redis", cluster.url]
                ps = [topo.sim(f"prefill-{i}", "kv_producer", speed=speed) for i in range(2)]
                ds = [topo.sim(f"decode-{i}", "kv_consumer", speed=speed) for i in range(2)]
                urls = [topo.router(f"router-{i}", ps, ds, *flags).url for i in range(count)]
                topo.wait()
                started = time.perf_counter()
                records = asyncio.run(_drive(urls, conversations, model))
                rows.append(_row(store, count, records, time.perf_counter() - started))
    out.mkdir(parents=True, exist_ok=True)
    (out / "replicas.json").write_bytes(msgspec.json.encode(rows))
    (out / "replicas.md").write_text(render(rows))
    _plot(rows, out / "replicas.png")
    return rows


def render(rows: Sequence[ReplicasRow]) -> str:
    lines = [
        "| store | routers | turns | errors | reuse share (turns 2+) | turns/s | TTFT p50 turns 2+ (ms) |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        lines.append(
            f"| {row.store} | {row.routers} | {row.turns} | {row.errors} | {row.reuse_share:.2f} "
            f"| {row.turns_per_second:.1f} | {row.ttft_p50_ms:.0f} |"
        )
    return "\n".join(lines) + "\n"


def _plot(rows: Sequence[ReplicasRow], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (share, rate) = plt.subplots(1, 2, figsize=(10, 4))
    for store in dict.fromkeys(row.store for row in rows):
        mine = [row for row in rows if row.store == store]
        counts = [row.routers for row in mine]
        share.plot(counts, [row.reuse_share for row in mine], marker="o", label=store)
        rate.plot(counts, [row.turns_per_second for row in mine], marker="o", label=store)
    counts = sorted({row.routers for row in rows})
    share.set(xlabel="router processes", ylabel="reuse share, turns 2+", ylim=(0, 1.05))
    rate.set(xlabel="router processes", ylabel="turns/s")
    rate.set_ylim(bottom=0)
    for axes in (share, rate):
        axes.set_xscale("log", base=2)
        axes.set_xticks(counts, [str(c) for c in counts])
        axes.legend()
        axes.grid(alpha=0.3)
    figure.suptitle("Turns spread over router replicas (simulated 2 P + 2 D, one 2-core machine)")
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)
