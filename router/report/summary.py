"""The report itself, from merged samples: pure, no I/O.

Quantiles come from the histograms' buckets as Prometheus' ``histogram_quantile`` computes
them (linear within the bucket that holds the rank), so they are as coarse as the buckets:
``router/metrics.py`` has 15 latency buckets from 0.5 ms to 30 s.
"""

from __future__ import annotations

import math
from collections import defaultdict

import msgspec

from carryover.router.report.samples import Samples

__all__ = ["DecodeHeld", "Report", "TurnTtft", "markdown", "quantile", "summarize"]

#: ``carryover_ttft_seconds``' turn label, in turn order (router.metrics.turn_bucket).
TURN_BUCKETS = ("1", "2", "3-5", "6-10", "11-20", "21+")

#: The series the report reads: what a Prometheus server is asked for.
READ_COUNTERS = (
    "carryover_ttft_seconds_bucket",
    "carryover_prefill_done_seconds_bucket",
    "carryover_responses_total",
    "carryover_turns_total",
    "carryover_prompt_tokens_total",
    "carryover_warm_tier_turns_total",
    "carryover_warm_tier_tokens_total",
    "carryover_store_errors_total",
    "carryover_retries_total",
    "carryover_handles_released_total",
    "carryover_handles_left_to_expire_total",
)
READ_GAUGES = (
    "carryover_decode_handles",
    "carryover_decode_handle_oldest_age_seconds",
    "carryover_in_flight",  # one series per router: counts the replicas
)


class TurnTtft(msgspec.Struct, frozen=True):
    turns: str
    count: int
    p50_ms: float | None
    p99_ms: float | None


class DecodeHeld(msgspec.Struct, frozen=True):
    handles: int
    oldest_age_s: float


class Report(msgspec.Struct, frozen=True):
    window_s: float | None  # None: everything since the routers started
    routers: int
    ttft: list[TurnTtft]
    #: arrival to P's answer by turn, streamed or not (what a handle shortens)
    prompt_ready: list[TurnTtft]
    #: p50 of turns 3-5 and 6-10 over p50 of turn 1 (streamed turns).
    ratio_3_5: float | None
    ratio_6_10: float | None
    turns_by_path: dict[str, int]
    prompt_tokens_reused: int
    prompt_tokens_computed: int
    warm_tier_turns: dict[str, int]
    warm_tier_tokens: int
    store_errors: dict[str, int]
    retries: dict[str, int]
    handles_released: dict[str, int]
    handles_left_to_expire: dict[str, int]
    decode_held: dict[str, DecodeHeld]
    responses: dict[str, int]  # by HTTP status

    @property
    def reused_share(self) -> float | None:
        total = self.prompt_tokens_reused + self.prompt_tokens_computed
        return self.prompt_tokens_reused / total if total else None


def quantile(q: float, buckets: list[tuple[float, float]]) -> float | None:
    """The ``q`` quantile of a histogram given as (upper bound, cumulative count), sorted by
    bound and ending with ``+Inf``; ``None`` without observations."""
    if not buckets or buckets[-1][1] <= 0:
        return None
    rank = q * buckets[-1][1]
    lower, below = 0.0, 0.0
    for bound, count in buckets:
        if count >= rank:
            if math.isinf(bound):
                return lower  # beyond the last finite bound: all that can be said
            if count == below:
                return bound
            return lower + (bound - lower) * (rank - below) / (count - below)
        lower, below = bound, count
    return lower


def _by(samples: Samples, name: str, label: str) -> dict[str, int]:
    """A counter's totals by one label, summed over the others."""
    totals: dict[str, float] = defaultdict(float)
    for (sample, labels), value in samples.items():
        if sample == name:
            totals[dict(labels).get(label, "")] += value
    return {k: round(v) for k, v in sorted(totals.items()) if v}


def _histogram(samples: Samples, name: str, label: str) -> dict[str, list[tuple[float, float]]]:
    per: dict[str, dict[float, float]] = defaultdict(dict)
    for (sample, labels), value in samples.items():
        if sample != f"{name}_bucket":
            continue
        found = dict(labels)
        bound = float(found["le"])
        key = found.get(label, "")
        per[key][bound] = per[key].get(bound, 0.0) + value
    return {key: sorted(bounds.items()) for key, bounds in per.items()}


def _gauge(samples: Samples, name: str, label: str) -> dict[str, float]:
    """A fleet gauge by one label: the largest value where replicas report it apart (series
    from a Prometheus server keep their target labels)."""
    largest: dict[str, float] = {}
    for (sample, labels), value in samples.items():
        if sample == name:
            key = dict(labels).get(label, "")
            largest[key] = max(value, largest.get(key, value))
    return largest


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 1)


def _by_turn(samples: Samples, name: str) -> list[TurnTtft]:
    """A latency histogram's count and quantiles per turn bucket, in turn order (requests
    without a conversation have no turn and are left out)."""
    hist = _histogram(samples, name, "turn")
    rows = []
    for turns in TURN_BUCKETS:
        buckets = hist.get(turns)
        if not buckets or buckets[-1][1] <= 0:
            continue
        rows.append(
            TurnTtft(
                turns,
                round(buckets[-1][1]),
                _ms(quantile(0.5, buckets)),
                _ms(quantile(0.99, buckets)),
            )
        )
    return rows


def summarize(samples: Samples, *, window_s: float | None, routers: int) -> Report:
    ttft = _by_turn(samples, "carryover_ttft_seconds")
    p50 = {row.turns: row.p50_ms for row in ttft}

    def ratio(turns: str) -> float | None:
        first, later = p50.get("1"), p50.get(turns)
        return round(later / first, 2) if first and later is not None else None

    tokens = _by(samples, "carryover_prompt_tokens_total", "kind")
    held = _gauge(samples, "carryover_decode_handles", "server")
    oldest = _gauge(samples, "carryover_decode_handle_oldest_age_seconds", "server")
    return Report(
        window_s=window_s,
        routers=routers,
        ttft=ttft,
        prompt_ready=_by_turn(samples, "carryover_prefill_done_seconds"),
        ratio_3_5=ratio("3-5"),
        ratio_6_10=ratio("6-10"),
        turns_by_path=_by(samples, "carryover_turns_total", "path"),
        prompt_tokens_reused=tokens.get("reused", 0),
        prompt_tokens_computed=tokens.get("computed", 0),
        warm_tier_turns=_by(samples, "carryover_warm_tier_turns_total", "outcome"),
        warm_tier_tokens=sum(_by(samples, "carryover_warm_tier_tokens_total", "tier").values()),
        store_errors=_by(samples, "carryover_store_errors_total", "op"),
        retries=_by(samples, "carryover_retries_total", "cause"),
        handles_released=_by(samples, "carryover_handles_released_total", "cause"),
        handles_left_to_expire=_by(samples, "carryover_handles_left_to_expire_total", "cause"),
        decode_held={
            name: DecodeHeld(round(count), round(oldest.get(name, 0.0), 1))
            for name, count in sorted(held.items())
        },
        responses=_by(samples, "carryover_responses_total", "status"),
    )


def _counts(title: str, counts: dict[str, int]) -> list[str]:
    if not counts:
        return [f"{title}: none"]
    total = sum(counts.values())
    lines = [f"| {title} | count | share |", "|---|---|---|"]
    lines += [f"| {key} | {value} | {value / total:.0%} |" for key, value in counts.items()]
    return lines


def _fmt(value: float | None, unit: str = "") -> str:
    return "n/a" if value is None else f"{value:g}{unit}"


def markdown(report: Report) -> str:
    window = (
        "since the routers started"
        if report.window_s is None
        else f"over the last {report.window_s:g} s"
    )
    lines = [
        f"# carryover: live traffic of {report.routers} router(s), {window}",
        "",
        "## Time to first token of streamed turns, by turn",
        "",
    ]
    if report.ttft:
        lines += ["| turns | streamed | p50 | p99 |", "|---|---|---|---|"]
        lines += [
            f"| {r.turns} | {r.count} | {_fmt(r.p50_ms, ' ms')} | {_fmt(r.p99_ms, ' ms')} |"
            for r in report.ttft
        ]
        lines += [
            "",
            f"turns 3-5 / turn 1 (p50): {_fmt(report.ratio_3_5)}; "
            f"turns 6-10 / turn 1: {_fmt(report.ratio_6_10)}",
        ]
    else:
        lines.append("no streamed turns")
    lines += ["", "## Prompt ready at D (P answered), by turn, streamed or not", ""]
    if report.prompt_ready:
        lines += ["| turns | count | p50 | p99 |", "|---|---|---|---|"]
        lines += [
            f"| {r.turns} | {r.count} | {_fmt(r.p50_ms, ' ms')} | {_fmt(r.p99_ms, ' ms')} |"
            for r in report.prompt_ready
        ]
    else:
        lines.append("no turn of a conversation had a P leg")
    share = report.reused_share
    lines += [
        "",
        "## Turns by path",
        "",
        *_counts("path", report.turns_by_path),
        "",
        "## Prompt tokens",
        "",
        f"reused from D (not computed by P): {report.prompt_tokens_reused}; "
        f"computed by P: {report.prompt_tokens_computed}; "
        f"reused share: {'n/a' if share is None else f'{share:.0%}'}",
    ]
    if report.warm_tier_turns:
        lines += [
            "",
            "## Warm tier",
            "",
            *_counts("outcome", report.warm_tier_turns),
            "",
            f"prompt tokens expected from the tier: {report.warm_tier_tokens}",
        ]
    lines += [
        "",
        "## Responses and store errors and retries",
        "",
        *_counts("HTTP status", report.responses),
        "",
        *_counts("store call", report.store_errors),
        "",
        *_counts("retry cause", report.retries),
        "",
        "## Handles",
        "",
        *_counts("released, by cause", report.handles_released),
        "",
        *_counts("left to expire, by cause", report.handles_left_to_expire),
        "",
    ]
    if report.decode_held:
        lines += ["| decode instance | handles held | oldest |", "|---|---|---|"]
        lines += [
            f"| {name} | {held.handles} | {held.oldest_age_s:g} s |"
            for name, held in report.decode_held.items()
        ]
    else:
        lines.append("no decode instance holds a stored handle")
    return "\n".join(lines) + "\n"
