"""Turn the timed turns of every arm into tables, ratios, goodput, a JSON file and a plot."""

from __future__ import annotations

import json
from collections import Counter, defaultdict
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from carryover.bench.report_costs import cost_sections, fmt, percent
from carryover.bench.report_plot import plot
from carryover.bench.runner import TurnRecord

__all__ = [
    "Slo",
    "answers_differing",
    "build_report",
    "percentile",
    "render_markdown",
    "write_report",
]


def percentile(values: Sequence[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default), ``q`` in [0, 100]."""
    if not values:
        raise ValueError("percentile of nothing")
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low = int(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


class Slo:
    """``ttft=2000ms,itl=50ms``: a turn is good when its TTFT and its p99 ITL are within."""

    def __init__(self, ttft: float | None = None, itl: float | None = None) -> None:
        self.ttft, self.itl = ttft, itl

    @classmethod
    def parse(cls, text: str | None) -> Slo:
        slo = cls()
        for part in (text or "").split(","):
            if not part:
                continue
            name, _, value = part.partition("=")
            seconds = (
                float(value.removesuffix("ms")) / 1000
                if value.endswith("ms")
                else float(value.removesuffix("s"))
            )
            if name == "ttft":
                slo.ttft = seconds
            elif name == "itl":
                slo.itl = seconds
            else:
                raise ValueError(f"unknown SLO {name!r}")
        return slo

    def scaled(self, factor: float) -> Slo:
        """The same SLO on a clock running ``factor`` times as fast (bench fleet's time scale)."""
        return Slo(
            self.ttft * factor if self.ttft is not None else None,
            self.itl * factor if self.itl is not None else None,
        )

    def met(self, record: TurnRecord) -> bool:
        if record.status != 200 or record.error is not None or record.ttft is None:
            return False
        if self.ttft is not None and record.ttft > self.ttft:
            return False
        return not (self.itl is not None and record.itl and percentile(record.itl, 99) > self.itl)

    def describe(self) -> str:
        parts = []
        if self.ttft is not None:
            parts.append(f"TTFT ≤ {self.ttft * 1000:g} ms")
        if self.itl is not None:
            parts.append(f"p99 ITL ≤ {self.itl * 1000:g} ms")
        return ", ".join(parts) or "none"


#: Turns from this one on are "later turns" (the goals compare them).
LATER_TURN = 5
#: Turn ranges of the bucketed table: (label, first, last).
TURN_BUCKETS = (
    ("1", 1, 1),
    ("2-4", 2, 4),
    ("5-8", 5, 8),
    ("9-16", 9, 16),
    ("17-32", 17, 32),
    ("33+", 33, 1 << 30),
)
#: Workloads with more turns than this get the bucketed table instead of one row a turn.
_ROWS_PER_TURN_UP_TO = 12


def answers_differing(answered: list[TurnRecord], baseline: dict[tuple[str, int], str]) -> int:
    """Turns whose answer differs from the baseline arm's with the same history: a
    conversation is compared turn by turn up to its first difference, or to a turn the
    baseline did not answer. Its later turns carry a different history (each arm's own
    answers), so they would differ without being wrong."""
    by_conversation: dict[str, dict[int, str]] = defaultdict(dict)
    for r in answered:
        by_conversation[r.conversation][r.turn] = r.answer
    differ = 0
    for conversation, answers in by_conversation.items():
        for turn in sorted(answers):
            want = baseline.get((conversation, turn))
            if want is None:
                break
            if want != answers[turn]:
                differ += 1
                break
    return differ


def build_report(
    records: Sequence[TurnRecord],
    *,
    baseline_arm: str | None,
    slo: Slo,
    wall_seconds: dict[str, float],
    meta: dict[str, Any] | None = None,
    sources: dict[str, dict[str, float]] | None = None,
) -> dict[str, Any]:
    """``sources``: per arm, the engines' prompt tokens by ``role/source`` (reported per
    turn, so arms of different lengths compare)."""
    by_arm: dict[str, list[TurnRecord]] = defaultdict(list)
    for record in records:
        by_arm[record.arm].append(record)
    baseline = {
        (r.conversation, r.turn): r.answer
        for r in by_arm.get(baseline_arm or "", [])
        if r.error is None
    }
    arms: dict[str, Any] = {}
    for arm, rows in by_arm.items():
        ok = [r for r in rows if r.error is None and r.status == 200 and r.ttft is not None]
        turns: dict[int, list[float]] = defaultdict(list)
        for r in ok:
            assert r.ttft is not None
            turns[r.turn].append(r.ttft)
        per_turn = {
            t: {
                "n": len(v),
                "ttft_p50_ms": percentile(v, 50) * 1000,
                "ttft_p99_ms": percentile(v, 99) * 1000,
            }
            for t, v in sorted(turns.items())
        }
        later = [x for t, v in turns.items() if t >= LATER_TURN for x in v]
        buckets = {
            label: [x for t, v in turns.items() if low <= t <= high for x in v]
            for label, low, high in TURN_BUCKETS
        }
        itl = [x for r in ok for x in r.itl]
        last = max(turns) if turns else None
        first = per_turn.get(1, {}).get("ttft_p50_ms")

        def ratio(
            turn: int | None,
            per_turn: dict[int, dict[str, float]] = per_turn,
            first: float | None = first,
        ) -> float | None:
            if turn is None or not first or turn not in per_turn:
                return None
            return per_turn[turn]["ttft_p50_ms"] / first

        differ = answers_differing(ok, baseline)
        good = sum(1 for r in rows if slo.met(r))
        arms[arm] = {
            "turns": per_turn,
            "buckets": {
                label: {
                    "n": len(v),
                    "ttft_p50_ms": percentile(v, 50) * 1000,
                    "ttft_p99_ms": percentile(v, 99) * 1000,
                }
                for label, v in buckets.items()
                if v
            },
            "later_ttft_p50_ms": percentile(later, 50) * 1000 if later else None,
            "later_ttft_p99_ms": percentile(later, 99) * 1000 if later else None,
            "ratio_turn5_turn1": ratio(5),
            "ratio_last_turn1": ratio(last),
            "last_turn": last,
            "itl_p50_ms": percentile(itl, 50) * 1000 if itl else None,
            "itl_p99_ms": percentile(itl, 99) * 1000 if itl else None,
            "requests": len(rows),
            "failed": len(rows) - len(ok),
            "paths": dict(Counter(r.path or "direct" for r in rows)),
            "answers_differing_from_baseline": differ if baseline and arm != baseline_arm else None,
            "goodput_share": good / len(rows) if rows else 0.0,
            "goodput_per_s": good / wall_seconds[arm] if wall_seconds.get(arm) else None,
            "wall_seconds": wall_seconds.get(arm),
            # What the clients were told their prompts held, per turn: every prompt token is
            # one each engine computed, found in its cache or pulled (the engines' counters).
            "client_prompt_tokens_per_turn": (
                sum(r.prompt_tokens or 0 for r in ok) / len(ok) if ok else None
            ),
            "prompt_tokens_per_turn": {
                key: value / len(ok) for key, value in sorted((sources or {}).get(arm, {}).items())
            }
            if ok
            else {},
        }
    return {"meta": meta or {}, "slo": slo.describe(), "baseline_arm": baseline_arm, "arms": arms}


def lag_summary(
    lags: Sequence[float], collections: dict[str, list[float]] | None = None
) -> dict[str, float] | None:
    """How late a loop ran its timers (seconds in, milliseconds out), and with
    ``collections`` (pass lengths by generation) its garbage collector's time; None without
    samples."""
    if not lags:
        return None
    summary = {
        "mean_ms": sum(lags) / len(lags) * 1000,
        "p50_ms": percentile(lags, 50) * 1000,
        "p99_ms": percentile(lags, 99) * 1000,
        "max_ms": max(lags) * 1000,
    }
    if collections is not None:
        passes = [length for lengths in collections.values() for length in lengths]
        summary["gc_ms"] = sum(passes) * 1000
        summary["gc_max_ms"] = max(passes, default=0.0) * 1000
        summary["full_passes"] = float(len(collections.get("2", ())))
    return summary


def render_markdown(report: dict[str, Any]) -> str:
    arms = report["arms"]
    names = list(arms)
    all_turns = sorted({int(t) for a in arms.values() for t in a["turns"]})
    lines = ["# carryover multi-turn benchmark", ""]
    meta = report.get("meta") or {}
    if meta:
        lines += [", ".join(f"{k}: {v}" for k, v in meta.items()), ""]
    by_bucket = len(all_turns) > _ROWS_PER_TURN_UP_TO
    rows: list[tuple[str, str]] = (
        [(label, "buckets") for label, _, _ in TURN_BUCKETS]
        if by_bucket
        else [(str(t), "turns") for t in all_turns]
    )
    lines += [f"## TTFT p50 / p99 by turn{' range' if by_bucket else ''} (ms)", ""]
    lines.append("| turn | " + " | ".join(names) + " |")
    lines.append("|---|" + "---|" * len(names))
    for label, table in rows:
        cells = []
        for name in names:
            found = arms[name].get(table) or {}
            row = found.get(label) or (found.get(int(label)) if label.isdigit() else None)
            cells.append(f"{row['ttft_p50_ms']:.0f} / {row['ttft_p99_ms']:.0f}" if row else "-")
        if any(cell != "-" for cell in cells):
            lines.append(f"| {label} | " + " | ".join(cells) + " |")
    lines += ["", "## Summary", ""]
    lines.append(
        f"| arm | turns ≥ {LATER_TURN} p50 / p99 (ms) | turn-5/turn-1 | turn-T/turn-1 "
        "| ITL p50 / p99 (ms) | goodput | failed | wrong answers | paths |"
    )
    lines.append("|---|---|---|---|---|---|---|---|---|")
    for name in names:
        a = arms[name]
        paths = ", ".join(f"{k} {v}" for k, v in sorted(a["paths"].items()))
        lines.append(
            f"| {name} | {fmt(a.get('later_ttft_p50_ms'), 0)} / {fmt(a.get('later_ttft_p99_ms'), 0)} "
            f"| {fmt(a['ratio_turn5_turn1'], 2)} | {fmt(a['ratio_last_turn1'], 2)} "
            f"| {fmt(a['itl_p50_ms'])} / {fmt(a['itl_p99_ms'])} | {a['goodput_share'] * 100:.0f}% "
            f"| {a['failed']}/{a['requests']} | {fmt(a['answers_differing_from_baseline'])} | {paths} |"
        )
    lines += _sources_table(arms)
    lines += ["", f"Goodput: share of turns within the SLO ({report['slo']})."]
    if report["baseline_arm"]:
        lines.append(
            f"Wrong answers: turns whose answer differs from the `{report['baseline_arm']}` "
            "arm's with the same conversation so far (each conversation up to its first "
            "difference: its later turns carry each arm's own answers)."
        )
    decode_kv = report.get("decode_kv") or {}
    if decode_kv:
        lines += [
            "",
            "## Decode instances' KV over the run (their own gauges, sampled each second)",
            "",
        ]
        lines += [
            "| arm | KV use mean | KV use peak | held by pins, peak | pinned handles peak "
            "| given back under pressure | new pins not kept (D full) |"
        ]
        lines.append("|---|---|---|---|---|---|---|")
        for arm, kv in decode_kv.items():
            lines.append(
                f"| {arm} | {percent(kv['kv_usage_mean'])} | {percent(kv['kv_usage_peak'])} "
                f"| {percent(kv.get('pinned_usage_peak'))} "
                f"| {fmt(kv['pinned_handles_peak'], 0)} | {fmt(kv['relieved_handles'], 0)} "
                f"| {fmt(kv.get('pins_not_kept'), 0)} |"
            )
    lines += _router_turns_table(report.get("router_turns") or {})
    lines += cost_sections(report)
    commands = {arm: command for arm, command in (report.get("commands") or {}).items() if command}
    if commands:
        lines += ["", "## Each arm's router, as started", ""]
        lines += [f"- `{arm}`: `{command}`" for arm, command in commands.items()]
    lines.append("")
    return "\n".join(lines)


def _router_turns_table(own: dict[str, list[dict[str, Any]]]) -> list[str]:
    """Each carryover arm's turn-N by its own metrics' turn label (the Nth turn of the
    conversation: assistant turns in its history), beside the client's table above."""
    if not own:
        return []
    lines = [
        "",
        "## The router's own turn-N (its histograms' turn label: what `carryover report` reads)",
        "",
        "| arm | turns | count | arrival to P's answer p50 / p99 (ms) | TTFT p50 (streamed, ms) |",
        "|---|---|---|---|---|",
    ]
    for arm, rows in own.items():
        lines += [
            f"| {arm} | {row['turns']} | {row['count']} | {fmt(row['prompt_ready_p50_ms'], 0)} "
            f"/ {fmt(row['prompt_ready_p99_ms'], 0)} | {fmt(row['ttft_p50_ms'], 0)} |"
            for row in rows
        ]
    return lines


# Columns of the engines' prompt-token table: (role/source key, heading).
_SOURCE_COLUMNS = (
    ("prefill/local_compute", "P computed"),
    ("prefill/local_cache_hit", "P cache hit"),
    ("prefill/external_kv_transfer", "P pulled from D"),
    ("decode/external_kv_transfer", "D pulled from P"),
    ("decode/local_cache_hit", "D cache hit"),
    ("decode/local_compute", "D computed"),
    ("colocated/local_compute", "computed (colocated)"),
    ("colocated/local_cache_hit", "cache hit (colocated)"),
)


def _sources_table(arms: dict[str, Any]) -> list[str]:
    """Prompt tokens per turn by where each engine got them (its own counters)."""
    shown = [
        (key, heading)
        for key, heading in _SOURCE_COLUMNS
        if any(a.get("prompt_tokens_per_turn", {}).get(key) for a in arms.values())
    ]
    if not shown:
        return []
    lines = ["", "## Prompt tokens per turn, by the engines' counters", ""]
    lines.append("| arm | " + " | ".join(h for _, h in shown) + " |")
    lines.append("|---|" + "---|" * len(shown))
    for name, a in arms.items():
        per_turn = a.get("prompt_tokens_per_turn", {})
        cells = [f"{per_turn.get(key, 0.0):.0f}" for key, _ in shown]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return lines


def write_report(
    report: dict[str, Any], records: Sequence[TurnRecord], folder: Path
) -> dict[str, Path]:
    folder.mkdir(parents=True, exist_ok=True)
    paths = {
        "markdown": folder / "report.md",
        "json": folder / "report.json",
        "plot": folder / "ttft_by_turn.png",
        "turns": folder / "turns.jsonl",
    }
    paths["markdown"].write_text(render_markdown(report))
    paths["json"].write_text(json.dumps(report, indent=2))
    with paths["turns"].open("w") as out:
        for record in records:
            out.write(json.dumps(asdict(record)) + "\n")
    plot(report, paths["plot"])
    return paths
