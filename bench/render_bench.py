"""Render cost per turn: whole-prompt tokenization, span-by-span tokenization with the spans of
earlier turns cached (router/render/spans.py; new spans encoded as the router encodes them,
through router/render/fast_bpe.py where the tokenizer allows), and the same with each answer's
span tokenized after its turn, as the router does once a turn is committed
(``ChatTemplate.warm``): what is left on the next turn's path. One run, the same conversations
for all three.

    python -m carryover.bench.render_bench [--conversations 30] [--turns 10] [--system-tokens 200]
        [--user-tokens 800] [--answer-tokens 200]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from typing import Any

from carryover.bench.workload import Distribution, WorkloadSpec, filler, generate
from carryover.router.render.chat_template import ChatTemplate


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m carryover.bench.render_bench")
    parser.add_argument("--conversations", type=int, default=30)
    parser.add_argument("--turns", type=int, default=10)
    parser.add_argument("--system-tokens", type=int, default=200)
    parser.add_argument("--user-tokens", type=int, default=800)
    parser.add_argument("--answer-tokens", type=int, default=200)
    args = parser.parse_args()
    # One template (and so one span cache) per arm: the arms do not warm each other.
    whole_t, spans_t, warmed_t = (ChatTemplate.qwen3(fast_spans=True) for _ in range(3))
    # "template" and "tokens" split the warmed arm: the Jinja render, then the span encode.
    arms = ("whole", "spans", "warmed", "template", "tokens")
    times: dict[str, dict[int, list[float]]] = {
        arm: {t: [] for t in range(1, args.turns + 1)} for arm in arms
    }
    lengths: dict[int, list[int]] = {t: [] for t in range(1, args.turns + 1)}
    spec = WorkloadSpec(
        conversations=args.conversations,
        turns=args.turns,
        system_tokens=Distribution("constant", args.system_tokens),
        user_tokens=Distribution("constant", args.user_tokens),
    )
    rng = random.Random(0)
    for conversation in generate(spec):
        history: list[dict[str, Any]] = [{"role": "system", "content": conversation.system}]
        for turn, user in enumerate(conversation.users, start=1):
            history.append({"role": "user", "content": user})
            started = time.perf_counter()
            text = whole_t.render_text(history)
            ids = whole_t.tokenizer.encode(text, add_special_tokens=False).ids
            times["whole"][turn].append(time.perf_counter() - started)
            started = time.perf_counter()
            assert spans_t.encode(spans_t.render_text(history)) == ids
            times["spans"][turn].append(time.perf_counter() - started)
            started = time.perf_counter()
            text = warmed_t.render_text(history)
            rendered = time.perf_counter()
            assert warmed_t.encode(text) == ids
            done = time.perf_counter()
            times["warmed"][turn].append(done - started)
            times["template"][turn].append(rendered - started)
            times["tokens"][turn].append(done - rendered)
            lengths[turn].append(len(ids))
            answer = filler(rng, args.answer_tokens)
            warmed_t.warm(answer)  # after the turn, off the next one's path
            history.append({"role": "assistant", "content": answer})
    print(
        "| turn | prompt tokens (median) | whole p50 | spans p50 | spans, answer warmed p50 "
        "| of which template / tokens |"
    )
    print("|---|---|---|---|---|---|")
    for turn in range(1, args.turns + 1):
        w, s, a, t, k = (statistics.median(times[arm][turn]) for arm in arms)
        print(
            f"| {turn} | {statistics.median(lengths[turn]):.0f} | {w * 1e3:.2f} ms "
            f"| {s * 1e3:.2f} ms | {a * 1e3:.2f} ms | {t * 1e3:.2f} / {k * 1e3:.2f} ms |"
        )


if __name__ == "__main__":
    main()
