"""The figures the router reads from an engine's ``/metrics``: load, KV usage, the KV cache's
size and the process's start time (a restart), one number each."""

from __future__ import annotations

import operator
from collections.abc import Callable

__all__ = ["KV_CAPACITY_TOKENS", "parse_gauges"]

#: Tokens of KV one rank's cache holds, from labels of ``vllm:cache_config_info`` (vLLM's
#: CacheConfig.metrics_info): ``kv_cache_size_tokens``, each rank's own; else ``num_gpu_blocks``
#: times ``block_size``, which vLLM 0.32 sums over data-parallel ranks
#: (``v1/engine/core_client.py``). The smallest of the lines.
KV_CAPACITY_TOKENS = "kv_capacity_tokens"
_CACHE_INFO = "vllm:cache_config_info"

#: The engine gauges read, and how the label sets of one (an engine's data-parallel ranks, each
#: with its own ``engine`` label) combine: requests add up; a cache's usage is a fraction of
#: one rank's cache, so the fullest rank stands for the engine (where pressure shows first).
_GAUGES: dict[str, Callable[[float, float], float]] = {
    "vllm:num_requests_running": operator.add,
    "vllm:num_requests_waiting": operator.add,
    "vllm:kv_cache_usage_perc": max,
    "process_start_time_seconds": max,
}


def parse_gauges(text: str) -> dict[str, float]:
    """Each gauge of ``_GAUGES`` the text holds, its label sets combined; a sample line that
    does not parse is left out. Read by hand, not with prometheus_client's parser: it runs on
    every probe of every engine, and on a 400-line page (12 histograms) it took 0.45 ms against
    the library's 11.6 ms here."""
    values: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line[0] == "#":
            continue
        name_end = min((i for i in (line.find("{"), line.find(" ")) if i >= 0), default=-1)
        if name_end < 0:
            continue
        name = line[:name_end]
        if name == _CACHE_INFO:
            capacity = _capacity(line)
            if capacity is not None:
                values[KV_CAPACITY_TOKENS] = min(values.get(KV_CAPACITY_TOKENS, capacity), capacity)
            continue
        combine = _GAUGES.get(name)
        if combine is operator.add and _label(line, "reason") is not None:
            # A split of the total (vLLM publishes it as ``…_by_reason``; a split under the
            # total's own name would count each request twice).
            continue
        if combine is not None:
            try:
                value = float(line.rsplit(" ", 1)[1])
            except ValueError:
                continue
            values[name] = combine(values[name], value) if name in values else value
    return values


def _label(line: str, name: str) -> str | None:
    """The value of label ``name`` (not of one whose name ends with it: ``mamba_block_size``)."""
    for opening in ("{", ","):
        start = line.find(f'{opening}{name}="')
        if start >= 0:
            start += len(name) + 3
            end = line.find('"', start)
            return line[start:end] if end >= 0 else None
    return None


def _capacity(line: str) -> float | None:
    """Tokens of KV in the cache ``vllm:cache_config_info``'s line describes (None before the
    engine has sized its cache, or on a line without the labels)."""
    try:
        return float(int(_label(line, "kv_cache_size_tokens") or ""))
    except ValueError:
        pass
    blocks, size = _label(line, "num_gpu_blocks"), _label(line, "block_size")
    try:
        return float(int(blocks or "") * int(size or ""))
    except ValueError:
        return None
