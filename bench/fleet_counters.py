"""What the fleet's engines and a router report of an arm, read from their own /metrics:
prompt tokens by source, the decoders' KV use sampled through the run, and what a carryover
router gave back under pressure."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from carryover.bench.procs import Process
from carryover.router.report.summary import summarize

__all__ = [
    "DecodeSampler",
    "engine_prompt_sources",
    "leg_means",
    "pressure_releases",
    "prompt_sources",
    "retries",
    "router_turns",
    "scrape",
    "wait_rendering",
]

_SOURCES = "vllm:prompt_tokens_by_source_total"


#: The decoders' gauges the sampler reads: KV use, pinned handles, share held by pins.
_SAMPLED = ("vllm:kv_cache_usage_perc", "sim:pinned_handles", "sim:pinned_kv_usage_perc")


def _gauges(client: httpx.Client, url: str, names: Sequence[str]) -> dict[str, float]:
    """Each of ``names`` in one read of ``url``'s /metrics, summed over its labels."""
    found = dict.fromkeys(names, 0.0)
    for family in text_string_to_metric_families(client.get(f"{url}/metrics").text):
        for sample in family.samples:
            if sample.name in found:
                found[sample.name] += sample.value
    return found


def scrape(url: str) -> list[Sample]:
    """Every sample of one read of ``url``'s /metrics."""
    text = httpx.get(f"{url}/metrics", timeout=30).text
    return [sample for family in text_string_to_metric_families(text) for sample in family.samples]


def wait_rendering(router_url: str, timeout: float = 60.0) -> None:
    """Until a carryover router renders in process: its check against P's ``/tokenize``
    (router/render/auto.py) runs once P answers, and until it has, turns are rendered by P.
    A benchmark's arm starts after it, as traffic would reach a router a few seconds old."""
    deadline = time.monotonic() + timeout
    while _summed(scrape(router_url), "carryover_render_check", state="pending").get("", 0.0):
        if time.monotonic() > deadline:
            raise RuntimeError(f"{router_url} still renders through P after {timeout:.0f} s")
        time.sleep(0.05)


def _summed(
    samples: Sequence[Sample], name: str, by: str | None = None, **labels: str
) -> dict[str, float]:
    """The samples named ``name`` whose labels include ``labels``, summed by the label ``by``
    (one total under "" without it)."""
    found: dict[str, float] = {}
    for sample in samples:
        if sample.name == name and labels.items() <= sample.labels.items():
            key = sample.labels[by] if by else ""
            found[key] = found.get(key, 0.0) + sample.value
    return found


class DecodeSampler:
    """Every ``interval``: the decode instances' mean KV cache use (pins included) and the
    handles they pin, read from their own /metrics, for as long as an arm runs."""

    def __init__(self, decodes: Sequence[str], interval: float = 1.0) -> None:
        # (seconds, mean use, pinned handles, mean share held by pins)
        self.samples: list[tuple[float, float, float, float]] = []
        self._decodes, self._interval = list(decodes), interval
        # One client for the run: a new one per scrape builds an SSL context, about 50 ms
        # of CPU, in the load generator's process (a third of a core at four decoders).
        self._client = httpx.Client(timeout=30)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._started = time.perf_counter()

    def __enter__(self) -> DecodeSampler:
        self._sample()  # the first read (a new client's connections) before the arm starts
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join()
        self._sample()  # and as the run left them
        self._client.close()

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            self._sample()

    def _sample(self) -> None:
        if not self._decodes:  # the colocated baseline
            return
        try:
            read = [_gauges(self._client, url, _SAMPLED) for url in self._decodes]  # one each
            usage, pinned, pinned_usage = (sum(r[n] for r in read) for n in _SAMPLED)
            usage, pinned_usage = usage / len(read), pinned_usage / len(read)
        except httpx.HTTPError:
            return
        self.samples.append((time.perf_counter() - self._started, usage, pinned, pinned_usage))


def pressure_releases(router: Sequence[Sample]) -> tuple[float, float]:
    """What a carryover router (its ``scrape``) gave back under decode KV pressure, by its
    own count: held handles (relief), and new ones not kept because their D was full at the
    turn's end."""
    fates = _summed(router, "carryover_handle_fates_total", by="cause", fate="released")
    return fates.get("decode_pressure", 0.0), fates.get("decode_full", 0.0)


def retries(router: Sequence[Sample]) -> dict[str, float]:
    """A carryover router's retries by cause (a P or D attempt that failed and ran again,
    ``carryover_retries_total``): why turns ran ``cold-error``."""
    return _summed(router, "carryover_retries_total", by="cause")


def router_turns(router: Sequence[Sample]) -> list[dict[str, Any]]:
    """A carryover router's own turn-N, by the turn label of its histograms (what ``carryover
    report`` shows an operator): per turn range, arrival to P's answer and, for streamed
    turns, to the first token."""
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value for s in router}
    report = summarize(samples, window_s=None, routers=1)
    ttft = {row.turns: row for row in report.ttft}
    return [
        {
            "turns": row.turns,
            "count": row.count,
            "prompt_ready_p50_ms": row.p50_ms,
            "prompt_ready_p99_ms": row.p99_ms,
            "ttft_p50_ms": ttft[row.turns].p50_ms if row.turns in ttft else None,
        }
        for row in report.prompt_ready
    ]


def leg_means(router: Sequence[Sample]) -> dict[str, float]:
    """A carryover router's mean time of each step of its turns (render, claim, prefill,
    decode, commit...), of its whole request and of its event loop's lag, in milliseconds,
    by its own histograms."""
    sums = _summed(router, "carryover_leg_seconds_sum", by="leg")
    counts = _summed(router, "carryover_leg_seconds_count", by="leg")
    means = {leg: sums.get(leg, 0.0) / n * 1000 for leg, n in sorted(counts.items()) if n}
    # The whole request as the router's handler saw it (carryover_request_seconds).
    whole = _summed(router, "carryover_request_seconds_sum")
    requests = _summed(router, "carryover_request_seconds_count")
    if requests.get(""):
        means["whole request"] = whole.get("", 0.0) / requests[""] * 1000
    lag = _summed(router, "carryover_event_loop_lag_seconds_sum")
    timers = _summed(router, "carryover_event_loop_lag_seconds_count")
    if timers.get(""):
        means["loop lag"] = lag.get("", 0.0) / timers[""] * 1000
    return means


def engine_prompt_sources(url: str) -> dict[str, float]:
    """One engine's prompt tokens by source: local_compute, local_cache_hit,
    external_kv_transfer."""
    return _summed(scrape(url), _SOURCES, by="source")


def prompt_sources(engines: Sequence[tuple[str, Process]]) -> dict[str, float]:
    """Sum each engine's prompt tokens by source, keyed ``role/source``."""
    totals: dict[str, float] = {}
    for role, engine in engines:
        for source, value in engine_prompt_sources(engine.url).items():
            key = f"{role}/{source}"
            totals[key] = totals.get(key, 0.0) + value
    return totals
