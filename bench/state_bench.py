"""State-layer numbers: plan() cost, claim+commit round trip, bytes per token, granularity.

Run: ``uv run python -m carryover.bench.state_bench`` (starts its own redis-server unless ``--redis URL``).
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import time

from carryover.bench.local_redis import local_redis
from carryover.state import ConversationKey, HashedTokens, Record, RedisStore, chunk_size_for, plan


def _record(ids: list[int], block_size: int, turn: int = 1) -> Record:
    chunk = chunk_size_for(block_size)
    now = time.time()
    blocks = -(-len(ids) // block_size)
    handle = {
        "do_remote_prefill": False,
        "do_remote_decode": True,
        "remote_block_ids": [list(range(1000, 1000 + blocks))],
        "remote_engine_id": "3e86cff0-4a1b-4c1e-9a7f-2f1d2c3b4a5e",
        "remote_request_id": "chatcmpl-0123456789abcdef-0-83c0fc77",
        "remote_host": "10.0.0.12",
        "remote_port": 5600,
        "tp_size": 1,
        "dcp_size": 1,
        "pp_size": 1,
        "remote_num_tokens": len(ids),
        "remote_blocks_expiry_time": 2801.785553152,
        "remote_registration_generation": 0,
        "transfer_mode": "pull",
    }
    return Record(
        turn=turn,
        handle=handle,
        decode="decode-0",
        decode_epoch=0,
        block_size=block_size,
        prefix=HashedTokens(ids, chunk).prefix(len(ids), output_start=len(ids) - 200),
        created_at=now,
        expires_at=now + 470,
    )


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def bench_plan(sizes: list[int], block_size: int, repeats: int) -> None:
    print(f"plan() with hashing, block size {block_size} (prompt = history + 100 new tokens)")
    rng = random.Random(0)
    for size in sizes:
        history = [rng.randrange(151_000) for _ in range(size)]
        record = _record(history, block_size)
        prompt = history + [rng.randrange(151_000) for _ in range(100)]
        times = []
        for _ in range(repeats):
            started = time.perf_counter()
            result = plan(record, prompt, now=time.time(), decode_epoch=0)
            times.append(time.perf_counter() - started)
        assert result.reused_tokens == size
        print(
            f"  {size:>7} tokens: p50 {statistics.median(times) * 1e3:6.3f} ms"
            f"  p99 {_percentile(times, 0.99) * 1e3:6.3f} ms"
        )


def bench_bytes(sizes: list[int], block_size: int) -> None:
    print(f"bytes stored per token (msgpack record incl. handle), block size {block_size}")
    rng = random.Random(1)
    for size in sizes:
        record = _record([rng.randrange(151_000) for _ in range(size)], block_size)
        stored = len(record.to_bytes()) + 8
        print(f"  {size:>7} tokens: {stored:>7} bytes = {stored / size:.3f} bytes/token")


async def bench_store(url: str, rounds: int) -> None:
    store = RedisStore.from_url(url, timeout=1.0)
    record = _record(list(range(8192)), 16)
    key = ConversationKey("bench", "model", "conversation")
    times = []
    try:
        for turn in range(rounds):
            started = time.perf_counter()
            await store.claim(key)
            await store.commit(key, record, now=time.time())
            times.append(time.perf_counter() - started)
            del turn
    finally:
        await store.close()
    print("claim + commit round trip (loopback redis-server, 8k-token record)")
    print(
        f"  p50 {statistics.median(times) * 1e6:7.0f} us   p99 {_percentile(times, 0.99) * 1e6:7.0f} us"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--redis", help="redis URL (default: start a throwaway redis-server)")
    parser.add_argument("--repeats", type=int, default=50)
    args = parser.parse_args()
    sizes = [8192, 32768, 131072]
    for block in (16, 128):
        bench_plan(sizes, block, args.repeats)
    for block in (16, 128):
        bench_bytes([1024, *sizes], block)
    print("partial-reuse granularity (hash-chain chunk; exact block inside the tail)")
    for block in (16, 128):
        print(f"  block size {block:>3}: {chunk_size_for(block)} tokens")
    if args.redis:
        asyncio.run(bench_store(args.redis, 2000))
    else:
        with local_redis() as url:
            asyncio.run(bench_store(url, 2000))


if __name__ == "__main__":
    main()
