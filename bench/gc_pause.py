"""How long the garbage collector's full pass holds a router worker's event loop, with what a
busy worker keeps: the KV index of a fleet's blocks, the renderer's span cache, and the heap
startup leaves (modules, the app, the tokenizer). Every turn in flight waits out such a pass;
CPython starts one whenever the objects that survived younger passes grow by a quarter of the
tracked heap. Each part is built as the router builds it, then ``gc.collect()`` is timed (the
median of five); the startup heap is timed again after ``router.memory.settle_heap``.

    python -m carryover.bench.gc_pause [--instances 8] [--blocks 65536] [--span-chars 4000000]
"""

from __future__ import annotations

import argparse
import gc
import random
import statistics
import time

from carryover.bench.kv_index_bench import BLOCK, device_blocks
from carryover.router.kv.index import KvIndex
from carryover.router.memory import settle_heap

__all__ = ["main"]

_RUN = 512  # blocks a BlockStored carries


def _full_pass_ms() -> float:
    times = []
    for _ in range(5):
        start = time.perf_counter()
        gc.collect()
        times.append((time.perf_counter() - start) * 1000)
    return statistics.median(times)


def _index(instances: int, blocks: int, rng: random.Random) -> KvIndex:
    index = KvIndex()
    for n in range(instances):
        own = index.of(f"engine-{n}")
        for first in range(0, blocks, _RUN):
            count = min(_RUN, blocks - first)
            own.apply(device_blocks([rng.randrange(150_000) for _ in range(count * BLOCK)], rng))
    return index


def _spans(chars: int, rng: random.Random) -> object:
    from carryover.router.render.chat_template import ChatTemplate

    template = ChatTemplate.qwen3(fast_spans=True)
    words = ["tool", "result", "value", "error", "file", "line", "the", "of", "and", "42"]
    total = 0
    while total < chars:
        text = " ".join(rng.choice(words) for _ in range(400))
        template.encode(f"<|im_start|>tool\n{text}<|im_end|>")
        total += len(text)
    return template


def _app() -> object:
    from carryover.router.config.load import load_config
    from carryover.router.http.app import create_app

    config = load_config(
        ["--prefill", "http://127.0.0.1:9", "--decode", "http://127.0.0.1:10"], environ={}
    )
    return create_app(config)


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m carryover.bench.gc_pause")
    parser.add_argument("--instances", type=int, default=8)
    parser.add_argument("--blocks", type=int, default=65_536, help="indexed blocks an instance")
    parser.add_argument("--span-chars", type=int, default=4_000_000)
    args = parser.parse_args()
    rng = random.Random(0)
    rows: list[tuple[str, int, float]] = []
    kept: list[object] = [_app()]

    def measure(name: str) -> None:
        rows.append((name, len(gc.get_objects()), _full_pass_ms()))

    measure("startup heap (modules, the app)")
    settle_heap()
    measure("the same, frozen by settle_heap")
    kept.append(_index(args.instances, args.blocks, rng))
    measure(f"+ KV index of {args.instances * args.blocks:,} blocks")
    kept.append(_spans(args.span_chars, rng))
    measure(f"+ span cache of {args.span_chars:,} characters")
    print("| heap | objects the collector tracks | full pass (ms, median of 5) |")
    print("|---|---|---|")
    for name, tracked, ms in rows:
        print(f"| {name} | {tracked:,} | {ms:.1f} |")
    del kept


if __name__ == "__main__":
    main()
