"""What the KV index costs the router's process, in two parts:

- a lookup: how many leading blocks of a prompt an instance holds (``InstanceBlocks.cached``),
  for a prompt of ``--lookup-blocks`` blocks held whole, the median of many;
- the subscription: CPU per batch applied, with engines publishing decode steps' batches (one
  new block of 16 tokens each, as a streaming decoder does) at a steady rate. Each publisher
  is a process of its own; the subscriptions run in this process on one event loop, as in a
  router worker, and the process's CPU time is measured from the first batch to the last.

    python -m carryover.bench.kv_index_bench [--publishers 8] [--rate 100] [--seconds 10]
        [--lookup-blocks 2000]
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import random
import statistics
import time

import zmq
import zmq.asyncio
from prometheus_client import CollectorRegistry

from carryover.bench.ports import free_port
from carryover.router.kv.events import BlockHash, BlockStored, KVEventBatch, encode_batch
from carryover.router.kv.index import InstanceBlocks, KvIndex, Prompt
from carryover.router.kv.metrics import KvMetrics
from carryover.router.kv.subscriber import EventSubscriber

__all__ = ["BLOCK", "device_blocks", "main"]

BLOCK = 16


def device_blocks(
    token_ids: list[int], rng: random.Random, parent: BlockHash | None = None
) -> BlockStored:
    """A ``BlockStored`` of whole blocks of ``token_ids`` on the device, under random 32-byte
    hashes (vLLM's sha256), as an engine publishes them."""
    count = len(token_ids) // BLOCK
    hashes: list[BlockHash] = [rng.randbytes(32) for _ in range(count)]
    return BlockStored(
        block_hashes=hashes,
        parent_block_hash=parent,
        token_ids=token_ids[: count * BLOCK],
        block_size=BLOCK,
        lora_id=None,
        medium="GPU",
        lora_name=None,
    )


def _publish(endpoint: str, rate: float, count: int, seed: int) -> None:
    """``count`` batches at ``rate`` a second, each one block extending the last."""
    context = zmq.Context()
    socket = context.socket(zmq.PUB)
    socket.bind(endpoint)
    time.sleep(1.0)  # subscribers connect: PUB drops what nobody receives yet
    rng = random.Random(seed)
    parent: BlockHash | None = None
    start = time.perf_counter()
    for seq in range(count):
        stored = device_blocks([rng.randrange(150_000) for _ in range(BLOCK)], rng, parent)
        batch = KVEventBatch(time.time(), [stored])
        parent = stored.block_hashes[-1]
        socket.send_multipart((b"", seq.to_bytes(8, "big", signed=True), encode_batch(batch)))
        pause = start + (seq + 1) / rate - time.perf_counter()
        if pause > 0:
            time.sleep(pause)
    socket.close(linger=1000)
    context.term()


async def _subscribe(endpoints: list[str], count: int) -> tuple[float, float]:
    """CPU and wall seconds from the first batch applied to the last."""
    context = zmq.asyncio.Context()
    index = KvIndex()
    metrics = KvMetrics(CollectorRegistry())
    subscribers = [
        EventSubscriber(
            f"engine-{n}", endpoint, None, index.of(f"engine-{n}"), metrics, context=context
        )
        for n, endpoint in enumerate(endpoints)
    ]
    tasks = [asyncio.create_task(s.run()) for s in subscribers]
    while not any(s.last is not None for s in subscribers):
        await asyncio.sleep(0.001)
    cpu, wall = time.process_time(), time.perf_counter()
    while not all(s.last == count - 1 for s in subscribers):
        await asyncio.sleep(0.05)
        if time.perf_counter() - wall > count:  # a lost batch: never reached
            raise SystemExit("a publisher's batches did not all arrive")
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    context.destroy(linger=0)
    return cpu, wall


def _lookup_us(blocks: int) -> float:
    """Median microseconds of one lookup of a prompt held whole."""
    rng = random.Random(0)
    ids = [rng.randrange(150_000) for _ in range(blocks * BLOCK)]
    held = InstanceBlocks()
    held.apply(device_blocks(ids, rng))
    keys = Prompt(ids).keys(BLOCK)
    assert held.cached(keys).device_tokens == len(ids)
    times = []
    for _ in range(200):
        start = time.perf_counter()
        held.cached(keys)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def _fleet_lookup_us(blocks: int, instances: int) -> tuple[float, float]:
    """Median microseconds to ask every instance of one index about a prompt each holds
    whole, as a turn does (a fresh ``Prompt``, its keys already computed): through the
    index's shared holders, and by each instance's own walk."""
    rng = random.Random(0)
    ids = [rng.randrange(150_000) for _ in range(blocks * BLOCK)]
    index = KvIndex()
    names = [f"engine-{n}" for n in range(instances)]
    for name in names:
        index.of(name).apply(device_blocks(ids, rng))
    shared, own = [], []
    for _ in range(200):
        prompt = Prompt(ids)
        keys = prompt.keys(BLOCK)
        start = time.perf_counter()
        answers = [index.cached(name, prompt) for name in names]
        shared.append(time.perf_counter() - start)
        start = time.perf_counter()
        walked = [index.instances[name].cached(keys) for name in names]
        own.append(time.perf_counter() - start)
        assert answers == walked
    return statistics.median(shared) * 1e6, statistics.median(own) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m carryover.bench.kv_index_bench")
    parser.add_argument("--publishers", type=int, default=8)
    parser.add_argument("--rate", type=float, default=100.0, help="batches a second each")
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--lookup-blocks", type=int, default=2_000)
    args = parser.parse_args()
    lookup = _lookup_us(args.lookup_blocks)
    print(f"lookup of a prompt of {args.lookup_blocks:,} blocks held whole: {lookup:.1f} us")
    shared, own = _fleet_lookup_us(args.lookup_blocks, args.publishers)
    print(
        f"the same asked of {args.publishers} instances of one index holding it whole: "
        f"{shared:.1f} us (each instance's own walk: {own:.1f} us)"
    )
    count = int(args.rate * args.seconds)
    endpoints = [f"tcp://127.0.0.1:{free_port()}" for _ in range(args.publishers)]
    spawn = multiprocessing.get_context("spawn")
    publishers = [
        spawn.Process(target=_publish, args=(endpoint, args.rate, count, n))
        for n, endpoint in enumerate(endpoints)
    ]
    for process in publishers:
        process.start()
    try:
        cpu, wall = asyncio.run(_subscribe(endpoints, count))
    finally:
        for process in publishers:
            process.join(timeout=10)
            if process.is_alive():
                process.kill()
    batches = count * args.publishers
    print(
        f"{args.publishers} publishers x {args.rate:g} batches/s for {args.seconds:g} s: "
        f"{batches:,} batches, {cpu / batches * 1e6:.1f} us of CPU each, "
        f"{cpu / wall * 100:.0f}% of a core"
    )


if __name__ == "__main__":
    main()
