"""Turn-N on real engines already running (``device.py engines``): the same conversations
through each arm, one arm at a time, the engines' caches emptied between arms, and the
engines' own counters read around each.

Arms: ``carryover`` (reuse), ``carryover-no-reuse`` (the same router as a plain P/D proxy) and
``vllm-router:POLICY`` (vLLM Router in P/D mode). Turns are answered whole (``stream:
false``): vLLM 0.26, the version the lent machine's torch fits, returns D's handle only on a
whole answer (docs/gpu.md), so a turn's time is its time to the whole answer, the same
measure for every arm. ``prove`` checks the transfer before anything is timed: a router's
greedy answers equal to P's own with nothing cached, and P's pulled-token counter moving on
turn 2.

    python3 -m carryover.bench.gpu.turns prove --out DIR
    python3 -m carryover.bench.gpu.turns run --arms carryover,carryover-no-reuse --out DIR"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from carryover.bench.fleet_counters import scrape
from carryover.bench.peers import POLICIES
from carryover.bench.ports import free_port
from carryover.bench.procs import Process, wait_ready
from carryover.bench.report import Slo, build_report, render_markdown
from carryover.bench.runner import TurnRecord, run_arm
from carryover.bench.workload import Conversation, Distribution, WorkloadSpec, generate

__all__ = ["Engines", "Size", "counters", "prove", "run"]

#: Counters read from each engine before and after an arm (their differences are the arm's).
_COUNTED = (
    "vllm:prompt_tokens_by_source_total",
    "vllm:nixl_xfer_time_seconds_sum",
    "vllm:nixl_xfer_time_seconds_count",
    "vllm:nixl_bytes_transferred_sum",
    "vllm:time_to_first_token_seconds_sum",
    "vllm:time_to_first_token_seconds_count",
    "vllm:request_prefill_time_seconds_sum",
    "vllm:request_prefill_time_seconds_count",
    "vllm:nixl_num_failed_transfers_total",
    "vllm:nixl_num_kv_expired_reqs_total",
)


@dataclass(frozen=True)
class Engines:
    """Where P and D answer."""

    prefill: str = "http://127.0.0.1:8100"
    decode: str = "http://127.0.0.1:8200"
    served: str = "qwen3-8b-random"
    block_size: int = 16  # their --block-size (device.py)

    @property
    def urls(self) -> tuple[str, str]:
        return self.prefill, self.decode


@dataclass(frozen=True)
class Size:
    """Conversations of ``turns`` turns growing to about ``tokens`` prompt tokens."""

    tokens: int
    conversations: int
    turns: int = 10
    answer: int = 32

    def spec(self, seed: int) -> WorkloadSpec:
        system = self.tokens // 10
        user = (self.tokens - system) // self.turns - self.answer
        return WorkloadSpec(
            conversations=self.conversations,
            turns=self.turns,
            system_tokens=Distribution("constant", system),
            user_tokens=Distribution("constant", user),
            output_tokens=Distribution("constant", self.answer),
            tool_results=True,
            stream=False,
            seed=seed,
        )


def counters(url: str) -> dict[str, float]:
    """The ``_COUNTED`` samples of one engine, prompt tokens by source."""
    found: dict[str, float] = {}
    for sample in scrape(url):
        if sample.name not in _COUNTED:
            continue
        key = sample.name
        if "source" in sample.labels:
            key = f"{key}{{{sample.labels['source']}}}"
        found[key] = found.get(key, 0.0) + sample.value
    return found


def _difference(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {k: v - before.get(k, 0.0) for k, v in after.items() if v - before.get(k, 0.0)}


def reset_caches(urls: Sequence[str], deadline_s: float = 90.0) -> dict[str, bool]:
    """``POST /reset_prefix_cache`` on each engine (vLLM's dev mode) until it succeeds: blocks
    a release pinned on P stay until P's lease ends (docs/gpu.md). False where it never did,
    or the engine has no such endpoint (not in dev mode)."""
    done: dict[str, bool] = {}
    for url in urls:
        deadline = time.monotonic() + deadline_s
        while True:
            answer = httpx.post(f"{url}/reset_prefix_cache", timeout=30)
            ok = answer.status_code == 200 and "false" not in answer.text.lower()
            if ok or answer.status_code == 404 or time.monotonic() > deadline:
                done[url] = ok
                break
            time.sleep(2)
    return done


def router_command(arm: str, port: int, tokenizer: Path, engines: Engines) -> list[str]:
    """The command of ``arm``'s router in front of P and D."""
    name, _, policy = arm.partition(":")
    if name == "vllm-router":
        if policy not in POLICIES:
            raise ValueError(f"arm {arm!r}: vllm-router:POLICY, one of {', '.join(POLICIES)}")
        return [
            *(sys.executable, "-m", "vllm_router.launch_router", "--host", "127.0.0.1"),
            *("--port", str(port), "--vllm-pd-disaggregation", "--policy", policy),
            *("--prefill", engines.prefill, "--decode", engines.decode),
            *("--log-level", "warning"),
        ]
    if name not in ("carryover", "carryover-no-reuse"):
        raise ValueError(f"unknown arm {arm!r}: carryover, carryover-no-reuse, vllm-router:P")
    command = [sys.executable, "-m", "carryover", "serve", "--port", str(port)]
    command += ["--prefill", engines.prefill, "--decode", engines.decode]
    command += ["--tokenizer", str(tokenizer), "--block-size", str(engines.block_size)]
    command += ["--expose-path-header", "--log-level", "warning"]
    # A 32k-token first turn's P leg is seconds of prefill on an 8B model under load.
    command += ["--prefill-timeout", "300", "--first-byte-timeout", "300"]
    return [*command, "--no-reuse"] if name == "carryover-no-reuse" else command


@contextlib.contextmanager
def _router(arm: str, tokenizer: Path, engines: Engines, logs: Path) -> Iterator[Process]:
    """``arm``'s router in front of the engines, ready, stopped on the way out."""
    port = free_port()
    logs.mkdir(parents=True, exist_ok=True)
    log = logs / f"{arm.replace(':', '-')}.log"
    argv = router_command(arm, port, tokenizer, engines)
    with log.open("ab") as sink:
        popen = subprocess.Popen(
            argv, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True
        )
    router = Process(arm, f"http://127.0.0.1:{port}", popen, log, argv=argv)
    try:
        wait_ready(router, "/health" if arm.startswith("vllm-router") else "/ready", 120)
        yield router
    finally:
        router.stop()


def _arm(
    arm: str,
    conversations: list[Conversation],
    *,
    tokenizer: Path,
    logs: Path,
    engines: Engines,
) -> tuple[list[TurnRecord], float, dict[str, Any]]:
    peer = arm.startswith("vllm-router")
    with _router(arm, tokenizer, engines, logs) as router:
        url = router.url
        before = {"prefill": counters(engines.prefill), "decode": counters(engines.decode)}
        started = time.perf_counter()
        records = asyncio.run(
            run_arm(
                arm,
                url,
                conversations,
                model=engines.served,
                send_conversation_id=not peer,
                session_header=peer,
                progress=sys.stderr.isatty(),
            )
        )
        wall = time.perf_counter() - started
        counted = {
            "prefill": _difference(counters(engines.prefill), before["prefill"]),
            "decode": _difference(counters(engines.decode), before["decode"]),
        }
        if not peer:
            # What D keeps for the conversations goes back now, not at its TTL.
            for conversation in conversations:
                httpx.delete(f"{url}/v1/conversations/{conversation.id}", timeout=30)
    return records, wall, counted


def run(
    sizes: Sequence[Size],
    arms: Sequence[str],
    *,
    tokenizer: Path,
    out: Path,
    seed: int = 0,
    engines: Engines = Engines(),
) -> dict[str, Any]:
    """Every size's conversations through every arm; a report per size (build_report's, with
    ``carryover-no-reuse`` as the baseline that answers are compared with) plus each arm's
    engine counters, written to ``out/turns-TOKENS.json`` as each finishes."""
    out.mkdir(parents=True, exist_ok=True)
    reports: dict[str, Any] = {}
    for size in sizes:
        # Each size its own seed: no arm of one size finds another size's prompts cached.
        conversations = generate(size.spec(seed + size.tokens))
        records: list[TurnRecord] = []
        walls: dict[str, float] = {}
        counts: dict[str, Any] = {}
        resets: dict[str, Any] = {}
        for arm in arms:
            resets[arm] = reset_caches(engines.urls)
            rows, wall, counted = _arm(
                arm, conversations, tokenizer=tokenizer, logs=out / "logs", engines=engines
            )
            records += rows
            walls[arm] = wall
            counts[arm] = counted
            print(f"  {size.tokens} tokens, {arm}: {wall:.1f} s", file=sys.stderr, flush=True)
        sources = {
            arm: {
                f"{role}/{key.split('{')[1].rstrip('}')}": value
                for role, found in counted.items()
                for key, value in found.items()
                if key.startswith("vllm:prompt_tokens_by_source_total{")
            }
            for arm, counted in counts.items()
        }
        report = build_report(
            records,
            baseline_arm="carryover-no-reuse" if "carryover-no-reuse" in arms else None,
            slo=Slo.parse(None),
            wall_seconds=walls,
            meta={"tokens": size.tokens, "conversations": size.conversations, "seed": seed},
            sources=sources,
        )
        report["engines"] = counts
        report["resets"] = resets
        report["errors"] = [r.error for r in records if r.error][:5]
        reports[str(size.tokens)] = report
        (out / f"turns-{size.tokens}.json").write_text(json.dumps(report, indent=1))
        (out / f"turns-{size.tokens}.md").write_text(render_markdown(report))
    return reports


# --- the transfer proof ----------------------------------------------------------------------


def _chat(
    url: str, model: str, messages: list[dict[str, str]], tokens: int, **extra: Any
) -> dict[str, Any]:
    body = {"model": model, "messages": messages, "max_tokens": tokens, "temperature": 0}
    body.update(ignore_eos=True, **extra)
    answer = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=300)
    answer.raise_for_status()
    found: dict[str, Any] = answer.json()
    return found


def prove(
    *,
    tokenizer: Path,
    out: Path,
    conversations: int = 3,
    turns: int = 3,
    engines: Engines = Engines(),
) -> dict[str, Any]:
    """Through a carryover router (reuse), ``conversations`` of ``turns`` turns of about 2,000
    new tokens each, P's prefix cache emptied before every later turn (so that the history
    can only come from D); every answer compared with P's own answer to the same messages
    under a fresh ``cache_salt`` (one engine, nothing cached), and P's
    ``external_kv_transfer`` tokens read around every turn."""
    reset_caches(engines.urls)
    spec = Size(tokens=2000 * turns, conversations=conversations, turns=turns, answer=24)
    chats = generate(spec.spec(seed=7))
    rows: list[dict[str, Any]] = []
    with _router("carryover", tokenizer, engines, out / "logs") as router:
        url = router.url
        for conversation in chats:
            messages: list[dict[str, str]] = []
            if conversation.system:
                messages.append({"role": "system", "content": conversation.system})
            for turn, text in enumerate(conversation.users):
                messages.append({"role": "user", "content": text})
                # P forgets the history: what it has of it must come from D's handle.
                emptied = reset_caches([engines.prefill])[engines.prefill] if turn else None
                before = counters(engines.prefill)
                started = time.perf_counter()
                routed = _chat(url, engines.served, messages, 24, conversation_id=conversation.id)
                seconds = time.perf_counter() - started
                pulled = _difference(counters(engines.prefill), before).get(
                    "vllm:prompt_tokens_by_source_total{external_kv_transfer}", 0.0
                )
                salt = f"prove-{conversation.id}-{turn}"
                alone = _chat(engines.prefill, engines.served, messages, 24, cache_salt=salt)
                mine = routed["choices"][0]["message"]["content"]
                theirs = alone["choices"][0]["message"]["content"]
                rows.append(
                    {
                        "conversation": conversation.id,
                        "turn": turn + 1,
                        "prompt_tokens": routed["usage"]["prompt_tokens"],
                        "p_pulled_tokens": pulled,
                        "p_cache_emptied": emptied,
                        "equal": mine == theirs,
                        "first_difference": _first_difference(mine, theirs),
                        "seconds": round(seconds, 3),
                    }
                )
                messages.append({"role": "assistant", "content": mine})
    later = [r for r in rows if r["turn"] > 1]
    proof = {
        "turns": rows,
        "equal": sum(r["equal"] for r in rows),
        "of": len(rows),
        "later_turns_pulling": sum(r["p_pulled_tokens"] > 0 for r in later),
        "later_turns": len(later),
    }
    (out / "prove.json").write_text(json.dumps(proof, indent=1))
    return proof


def _first_difference(mine: str, theirs: str) -> int | None:
    """The first character where two answers differ (None: equal)."""
    for index, (a, b) in enumerate(zip(mine, theirs, strict=False)):
        if a != b:
            return index
    return None if len(mine) == len(theirs) else min(len(mine), len(theirs))


def _sizes(text: str) -> list[Size]:
    """``8000x4,16000x4,32000x4``: tokens x conversations."""
    sizes = []
    for part in text.split(","):
        tokens, _, count = part.partition("x")
        sizes.append(Size(int(tokens), int(count or 8)))
    return sizes


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m carryover.bench.gpu.turns")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("prove")
    r = sub.add_parser("run")
    r.add_argument("--arms", default="carryover-no-reuse,carryover")
    r.add_argument("--sizes", type=_sizes, default=_sizes("8000x4,16000x4,32000x4"))
    r.add_argument("--seed", type=int, default=0)
    for each in (p, r):
        each.add_argument("--tokenizer", type=Path, default=Path("/tmp/gpu/model"))
        each.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "results/gpu")))
    args = parser.parse_args(argv)
    if args.command == "prove":
        proof = prove(tokenizer=args.tokenizer, out=args.out)
        print(json.dumps({k: v for k, v in proof.items() if k != "turns"}))
        for row in proof["turns"]:
            print(json.dumps(row))
        return
    reports = run(args.sizes, args.arms.split(","), tokenizer=args.tokenizer, out=args.out)
    for tokens, report in reports.items():
        print(f"## {tokens} tokens")
        for arm, row in report["arms"].items():
            turns = row["turns"]
            cells = [f"{t}:{turns[t]['ttft_p50_ms']:.0f}" for t in sorted(turns)]
            print(f"{arm}: later p50 {row['later_ttft_p50_ms']}, p99 {row['later_ttft_p99_ms']}")
            print("   ", " ".join(cells), "failed", row["failed"])
            print("   ", json.dumps(row["prompt_tokens_per_turn"]))
        print("engines", json.dumps(report["engines"]))
        print("errors", report["errors"])


if __name__ == "__main__":
    main()
