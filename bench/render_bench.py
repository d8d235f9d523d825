"""Render cost per turn: whole-prompt tokenization against span-by-span tokenization with the
spans of earlier turns cached (router/render/spans.py), in one run on the same conversations.

    python -m bench.render_bench [--conversations 30] [--turns 10] [--user-tokens 800]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from typing import Any

from bench.workload import Distribution, WorkloadSpec, filler, generate
from router.render.chat_template import ChatTemplate
from router.render.spans import SpanEncoder


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.render_bench")
    parser.add_argument("--conversations", type=int, default=30)
    parser.add_argument("--turns", type=int, default=10)
    parser.add_argument("--user-tokens", type=int, default=800)
    parser.add_argument("--answer-tokens", type=int, default=200)
    args = parser.parse_args()
    template = ChatTemplate.qwen3()
    whole: dict[int, list[float]] = {t: [] for t in range(1, args.turns + 1)}
    spans: dict[int, list[float]] = {t: [] for t in range(1, args.turns + 1)}
    lengths: dict[int, list[int]] = {t: [] for t in range(1, args.turns + 1)}
    encoder = SpanEncoder(template.tokenizer)
    spec = WorkloadSpec(
        conversations=args.conversations,
        turns=args.turns,
        user_tokens=Distribution("constant", args.user_tokens),
    )
    rng = random.Random(0)
    for conversation in generate(spec):
        history: list[dict[str, Any]] = [{"role": "system", "content": conversation.system}]
        for turn, user in enumerate(conversation.users, start=1):
            history.append({"role": "user", "content": user})
            started = time.perf_counter()
            text = template.render_text(history)
            ids = template.tokenizer.encode(text, add_special_tokens=False).ids
            whole[turn].append(time.perf_counter() - started)
            started = time.perf_counter()
            text = template.render_text(history)
            incremental = encoder.encode(text)
            spans[turn].append(time.perf_counter() - started)
            assert incremental == ids
            lengths[turn].append(len(ids))
            history.append({"role": "assistant", "content": filler(rng, args.answer_tokens)})
    print("| turn | prompt tokens (median) | whole p50 | spans p50 | spans / whole |")
    print("|---|---|---|---|---|")
    for turn in range(1, args.turns + 1):
        w, s = statistics.median(whole[turn]), statistics.median(spans[turn])
        print(
            f"| {turn} | {statistics.median(lengths[turn]):.0f} | {w * 1e3:.2f} ms "
            f"| {s * 1e3:.2f} ms | {s / w:.2f} |"
        )


if __name__ == "__main__":
    main()
