"""Render cost per turn: whole-prompt tokenization, span-by-span tokenization with the spans of
earlier turns cached (router/render/spans.py; new spans encoded as the router encodes them,
through router/render/fast_bpe.py where the tokenizer allows), and the same with each answer's
span tokenized after its turn, as the router does once a turn is committed
(``ChatTemplate.warm``): what is left on the next turn's path. One run, the same conversations
for all three. ``--family`` renders with one of the real tier's models (its tokenizer and
template); ``--engine`` also starts ``vllm serve`` of it (the real tier's environment) and
times its ``/tokenize`` of the same turns, checking its ids equal the router's.

    python -m carryover.bench.render_bench [--conversations 30] [--turns 10] [--system-tokens 200]
        [--user-tokens 800] [--answer-tokens 200] [--family qwen3|llama2|mistral] [--engine]
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from carryover.bench.workload import Distribution, WorkloadSpec, filler, generate
from carryover.router.render.chat_template import ChatTemplate, bundled_qwen3_dir


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m carryover.bench.render_bench")
    parser.add_argument("--conversations", type=int, default=30)
    parser.add_argument("--turns", type=int, default=10)
    parser.add_argument("--system-tokens", type=int, default=200)
    parser.add_argument("--user-tokens", type=int, default=800)
    parser.add_argument("--answer-tokens", type=int, default=200)
    parser.add_argument("--family", default="qwen3", help="qwen3 (bundled files), llama2, mistral")
    parser.add_argument("--engine", action="store_true", help="also time vllm serve's /tokenize")
    args = parser.parse_args()
    if args.family == "qwen3" and not args.engine:
        folder = bundled_qwen3_dir()
    else:
        from carryover.bench.real.launch import ensure_model

        folder = ensure_model(args.family)
    if not args.engine:
        print(_table(_run(args, folder, None), args.turns))
        return
    from carryover.bench.real.launch import served_name, single_engine

    with (
        tempfile.TemporaryDirectory() as logs,
        # A context long enough for every turn's prompt (/tokenize refuses one past it),
        # beyond the tiny model's positions: it only tokenizes here, it never runs them.
        single_engine(
            Path(logs) / "engine.log",
            *("--max-model-len", "32768"),
            family=args.family,
            env={"VLLM_ALLOW_LONG_MAX_MODEL_LEN": "1"},
        ) as (url, _),
        httpx.Client(timeout=60) as client,
    ):

        def tokenize(history: list[dict[str, Any]]) -> list[int]:
            body = {"model": served_name(args.family), "messages": history}
            answer = client.post(url + "/tokenize", json={**body, "add_generation_prompt": True})
            answer.raise_for_status()
            ids: list[int] = answer.json()["tokens"]
            return ids

        tokenize([{"role": "user", "content": "warm up"}])
        print(_table(_run(args, folder, tokenize), args.turns))


_ARMS = ("whole", "spans", "warmed", "template", "tokens", "engine")


def _run(
    args: argparse.Namespace,
    folder: Path,
    engine: Callable[[list[dict[str, Any]]], list[int]] | None,
) -> dict[str, dict[int, list[float]]]:
    # One template (and so one span cache) per arm: the arms do not warm each other.
    whole_t, spans_t, warmed_t = (ChatTemplate(folder, fast_spans=True) for _ in range(3))
    # "template" and "tokens" split the warmed arm: the Jinja render, then the span encode.
    times: dict[str, dict[int, list[float]]] = {
        arm: {t: [] for t in range(1, args.turns + 1)} for arm in (*_ARMS, "length")
    }
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
            times["length"][turn].append(len(ids))
            if engine is not None:
                started = time.perf_counter()
                assert engine(history) == ids, f"vLLM renders turn {turn} otherwise"
                times["engine"][turn].append(time.perf_counter() - started)
            answer = filler(rng, args.answer_tokens)
            warmed_t.warm(answer)  # after the turn, off the next one's path
            history.append({"role": "assistant", "content": answer})
    return times


def _table(times: dict[str, dict[int, list[float]]], turns: int) -> str:
    engine = any(times["engine"].values())
    lines = [
        "| turn | prompt tokens (median) | whole p50 | spans p50 | spans, answer warmed p50 "
        "| of which template / tokens |"
        + (" vLLM /tokenize p50 | warmed / vLLM |" if engine else ""),
        "|---|---|---|---|---|---|" + ("---|---|" if engine else ""),
    ]
    for turn in range(1, turns + 1):
        w, s, a, t, k = (statistics.median(times[arm][turn]) for arm in _ARMS[:5])
        line = (
            f"| {turn} | {statistics.median(times['length'][turn]):.0f} | {w * 1e3:.2f} ms "
            f"| {s * 1e3:.2f} ms | {a * 1e3:.2f} ms | {t * 1e3:.2f} / {k * 1e3:.2f} ms |"
        )
        if engine:
            e = statistics.median(times["engine"][turn])
            line += f" {e * 1e3:.2f} ms | {a / e:.2f} |"
        lines.append(line)
    return "\n".join(lines)


if __name__ == "__main__":
    main()
