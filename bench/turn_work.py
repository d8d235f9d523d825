"""The router's own work on a turn that grows with its prompt, step by step, as the turn does
it (the router's functions, one process, no engines): the client's body parsed, the prompt
rendered with the answers of earlier turns already tokenized (``ChatTemplate.warm``), the
prompt hashed for the store and keyed for the KV index, its ids encoded once for both legs'
bodies, the bodies encoded, P's answer
and D's first streamed chunk (each carrying the prompt's ids) read and checked against the
ids sent; the KV index asked what each of ``--instances`` engines holds of the prompt, each
holding it whole but the last block (as after the last turn, stored by its events).
Medians over the conversations, by turn, for the chat preset's shape by default.

    python -m carryover.bench.turn_work [--conversations 10] [--turns 20]
        [--system-tokens 1000] [--user-tokens 150] [--answer-tokens 600] [--instances 8]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Callable
from typing import Any, cast

import msgspec

from carryover.bench.kv_index_bench import BLOCK, device_blocks
from carryover.bench.workload import Distribution, WorkloadSpec, filler, generate
from carryover.router.config import InstanceConfig, ModelConfig
from carryover.router.kv.index import KvIndex, Prompt
from carryover.router.openai import BodyLimits, parse_body
from carryover.router.relay import DecodeOutput
from carryover.router.render.backends import Renderer
from carryover.router.render.chat_template import ChatTemplate, bundled_qwen3_dir
from carryover.router.turn.api import engine_api
from carryover.router.turn.model import Prepared, TurnRequest
from carryover.router.turn.path import Entry
from carryover.router.turn.placement import KvView
from carryover.router.turn.prefill_answer import read as read_prefill_answer
from carryover.router.turn.prefill_answer import same_ids
from carryover.router.turn.runtime import ModelRuntime
from carryover.state import HashedTokens, Path, Plan, Reason, chunk_size_for

STEPS = (
    "client body",
    "render",
    "store hashes",
    "index keys",
    "index lookups",
    "ids JSON",
    "legs' bodies",
    "P's answer",
    "D's first chunk",
)

_encoder = msgspec.json.Encoder()
#: The legs' bodies need a model; its engines are never called.
_MODEL = ModelConfig(
    prefill=[InstanceConfig("http://127.0.0.1:1")], decode=[InstanceConfig("http://127.0.0.1:2")]
)


def _turn(
    template: ChatTemplate, history: list[dict[str, Any]], instances: int
) -> tuple[dict[str, float], int]:
    """Seconds per step of one turn whose conversation so far is ``history``."""
    took: dict[str, float] = {}

    def timed(step: str, work: Callable[[], Any]) -> Any:
        started = time.perf_counter()
        result = work()
        took[step] = time.perf_counter() - started
        return result

    raw = _encoder.encode({"model": "m", "messages": history, "stream": True, "max_tokens": 600})
    body, _ = timed(
        "client body", lambda: parse_body(raw, chat=True, limits=BodyLimits(10_000, 1024, 128))
    )
    ids: list[int] = timed("render", lambda: template.encode(template.render_text(history)))
    hashed = timed("store hashes", lambda: HashedTokens(ids, chunk_size_for(16)))
    prompt = Prompt(ids, packed=hashed.packed)
    timed("index keys", lambda: prompt.keys(BLOCK))
    index = KvIndex()
    names = [f"engine-{n}" for n in range(instances)]
    rng = random.Random(len(ids))
    for name in names:
        index.of(name).apply(device_blocks(ids[: len(ids) - BLOCK], rng))
    looked_up = timed("index lookups", lambda: [index.cached(name, prompt) for name in names])
    assert all(c is not None and c.device_tokens >= len(ids) - 2 * BLOCK for c in looked_up)
    runtime = ModelRuntime(_MODEL, cast(Renderer, None), engine_api(_MODEL))
    req = TurnRequest(runtime, "m", None, body, True, True, False, "r", None)
    cold = Plan(Path.COLD, Reason.NO_RECORD)
    prepared = Prepared(
        ids, hashed, None, Entry(cold, True, True, True), KvView(None, None, None, None)
    )
    ids_json: bytes = timed("ids JSON", lambda: prepared.ids_json)
    handle = {"do_remote_decode": True, "remote_block_ids": [list(range(len(ids) // 16))]}

    def bodies() -> None:
        _encoder.encode(req.runtime.api.prefill(req, prepared, {"do_remote_decode": True})[1])
        _encoder.encode(req.runtime.api.decode(req, prepared, handle)[1])

    timed("legs' bodies", bodies)
    answer = _encoder.encode(
        {
            "choices": [{"index": 0, "message": {"content": "x"}}],
            "prompt_token_ids": ids,
            "kv_transfer_params": handle,
        }
    )
    ran = timed("P's answer", lambda: read_prefill_answer(answer).ran)
    assert ran is not None and same_ids(ran, ids, ids_json)
    first = _encoder.encode(
        {
            "choices": [{"index": 0, "delta": {"content": ""}, "token_ids": [1]}],
            "prompt_token_ids": ids,
        }
    )

    def first_chunk() -> None:
        output = DecodeOutput(client_wants_ids=False)
        output.chunk(first)
        assert output.ran(ids, ids_json)

    timed("D's first chunk", first_chunk)
    return took, len(ids)


def run(args: argparse.Namespace) -> dict[int, dict[str, list[float]]]:
    template = ChatTemplate(bundled_qwen3_dir(), fast_spans=True)
    spec = WorkloadSpec(
        conversations=args.conversations,
        turns=args.turns,
        system_tokens=Distribution("constant", args.system_tokens),
        user_tokens=Distribution("lognormal", args.user_tokens, sigma=0.6),
    )
    rng = random.Random(0)
    by_turn: dict[int, dict[str, list[float]]] = {}
    for conversation in generate(spec):
        history: list[dict[str, Any]] = [{"role": "system", "content": conversation.system}]
        for turn, user in enumerate(conversation.users, start=1):
            history.append({"role": "user", "content": user})
            took, length = _turn(template, history, args.instances)
            row = by_turn.setdefault(turn, {step: [] for step in (*STEPS, "tokens")})
            for step, seconds in took.items():
                row[step].append(seconds)
            row["tokens"].append(length)
            answer = filler(rng, args.answer_tokens)
            template.warm(answer)  # as the router does once a turn is committed
            history.append({"role": "assistant", "content": answer})
    return by_turn


def table(by_turn: dict[int, dict[str, list[float]]]) -> str:
    lines = [
        "| turn | prompt tokens | " + " | ".join(STEPS) + " | all (ms) |",
        "|---" * (len(STEPS) + 3) + "|",
    ]
    for turn, row in sorted(by_turn.items()):
        medians = [statistics.median(row[step]) * 1e3 for step in STEPS]
        cells = " | ".join(f"{m:.2f}" for m in medians)
        tokens = statistics.median(row["tokens"])
        lines.append(f"| {turn} | {tokens:,.0f} | {cells} | {sum(medians):.2f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m carryover.bench.turn_work")
    parser.add_argument("--conversations", type=int, default=10)
    parser.add_argument("--turns", type=int, default=20)
    parser.add_argument("--system-tokens", type=int, default=1000)
    parser.add_argument("--user-tokens", type=int, default=150)
    parser.add_argument("--answer-tokens", type=int, default=600)
    parser.add_argument("--instances", type=int, default=8, help="engines the index is asked of")
    print(table(run(parser.parse_args())))


if __name__ == "__main__":
    main()
