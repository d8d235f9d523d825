"""What a large request's steps hold the GIL for: ``python -m carryover.bench.large_request``.

Each step of a chat carrying a tool list of N MB (the churn soak's, bench/churn.py) runs in a
thread, as the router runs it, beside a thread that sleeps 1 ms at a time; the longest that
thread waited between wakeups is how long the step held every other thread, the event loop
included, at once. Python hands the GIL over every 5 ms between bytecodes, so ~6 ms is the
floor of this measure; more is one native call that does not give it up.
"""

from __future__ import annotations

import argparse
import json
import random
import threading
import time
from collections.abc import Callable
from typing import Any

from carryover.bench.churn import _tools
from carryover.router.openai import BodyLimits, parse_body
from carryover.router.render.chat_template import ChatTemplate
from carryover.router.render.context import PromptTooLong

__all__ = ["main", "measure"]


def measure(step: Callable[[], Any]) -> tuple[float, float]:
    """(the step's seconds, the longest a 1 ms ticker waited while it ran)."""
    gaps: list[float] = []
    done = threading.Event()

    def tick() -> None:
        last = time.perf_counter()
        while not done.is_set():
            time.sleep(0.001)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now

    ticker = threading.Thread(target=tick)
    ticker.start()
    took: list[float] = []

    def work() -> None:
        started = time.perf_counter()
        try:
            step()
        except PromptTooLong:
            pass  # the refusal is the step's end
        took.append(time.perf_counter() - started)

    worker = threading.Thread(target=work)
    worker.start()
    worker.join()
    done.set()
    ticker.join()
    return took[0], max(gaps, default=0.0)


def _steps(
    template: ChatTemplate, mb: float, context: int
) -> tuple[int, list[tuple[str, Callable[[], Any]]]]:
    """The body's size, and its steps in the order a turn runs them."""
    limits = BodyLimits(max_messages=4096, max_tools=1024, max_nesting_depth=128)
    messages = [{"role": "user", "content": "which tool?"}]
    raw = json.dumps(
        {"model": "m", "messages": messages, "tools": _tools(mb, random.Random(int(mb)))}
    ).encode()
    parsed: dict[str, Any] = {}

    def decode() -> None:
        parsed["body"] = parse_body(raw, chat=True, limits=limits)[0]

    def render() -> None:
        template.render_text(messages, tools=parsed["body"]["tools"])

    def render_counted() -> None:
        template.render(messages, tools=parsed["body"]["tools"], max_model_len=context)

    return len(raw), [
        ("decode and check the body", decode),
        ("render the template", render),
        (f"render and count, refused past {context} tokens", render_counted),
    ]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--mb", type=float, nargs="+", default=[1.0, 4.0, 10.0])
    parser.add_argument("--context", type=int, default=32768, help="the model's max_model_len")
    args = parser.parse_args(argv)
    template = ChatTemplate.qwen3(fast_spans=True)
    print("| body (MB) | step | took (ms) | longest wait of other threads (ms) |")
    print("|---|---|---|---|")
    for mb in args.mb:
        size, steps = _steps(template, mb, args.context)
        for name, step in steps:
            took, wait = measure(step)
            print(f"| {size / 1e6:.1f} | {name} | {took * 1000:.1f} | {wait * 1000:.1f} |")


if __name__ == "__main__":
    main()
