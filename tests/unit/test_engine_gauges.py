"""What the router reads from an engine's /metrics: one figure per gauge, whatever the number
of data-parallel ranks behind the engine."""

from __future__ import annotations

from carryover.router.engines.gauges import KV_CAPACITY_TOKENS, parse_gauges

TWO_RANKS = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 3.0
vllm:num_requests_running{engine="1",model_name="m"} 2.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 1.0
vllm:num_requests_waiting{engine="1",model_name="m"} 4.0
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.6
vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.7
# TYPE process_start_time_seconds gauge
process_start_time_seconds 1.7e9
"""


def test_requests_add_up_across_ranks_and_kv_usage_is_the_fullest_ranks() -> None:
    gauges = parse_gauges(TWO_RANKS)
    assert gauges["vllm:num_requests_running"] == 5.0
    assert gauges["vllm:num_requests_waiting"] == 5.0
    # A fraction of one rank's cache: the fullest rank is where pressure shows first. A sum
    # (1.3) would read as more than full.
    assert gauges["vllm:kv_cache_usage_perc"] == 0.7
    assert gauges["process_start_time_seconds"] == 1.7e9


def test_one_rank_reads_as_it_is() -> None:
    one = "\n".join(line for line in TWO_RANKS.splitlines() if 'engine="1"' not in line)
    gauges = parse_gauges(one)
    assert gauges["vllm:kv_cache_usage_perc"] == 0.6
    assert gauges["vllm:num_requests_running"] == 3.0


def test_the_kv_cache_s_size_in_tokens_is_the_smallest_rank_s() -> None:
    info = (
        'vllm:cache_config_info{block_size="16",cache_dtype="auto",engine="0",'
        'num_gpu_blocks="4096"} 1.0\n'
        'vllm:cache_config_info{mamba_block_size="999",block_size="16",engine="1",'
        'num_gpu_blocks="2048"} 1.0\n'
        'vllm:cache_config_info{block_size="16",engine="2",num_gpu_blocks="None"} 1.0\n'
    )
    assert parse_gauges(TWO_RANKS + info)[KV_CAPACITY_TOKENS] == 2048 * 16
    assert KV_CAPACITY_TOKENS not in parse_gauges(TWO_RANKS)


def test_each_rank_s_own_size_wins_over_blocks_summed_over_ranks() -> None:
    """vLLM sums num_gpu_blocks over data-parallel ranks; kv_cache_size_tokens is per rank."""
    info = "".join(
        f'vllm:cache_config_info{{block_size="16",engine="{rank}",kv_cache_size_tokens="65536",'
        f'num_gpu_blocks="8192"}} 1.0\n'
        for rank in (0, 1)
    )
    assert parse_gauges(TWO_RANKS + info)[KV_CAPACITY_TOKENS] == 65536


def test_waiting_split_by_reason_is_not_added_to_the_total() -> None:
    """vLLM 0.32 and 0.33 publish the split as its own gauge,
    ``vllm:num_requests_waiting_by_reason{reason=...}``, whose reasons sum to
    ``vllm:num_requests_waiting`` (``vllm/v1/metrics/loggers.py``): the total is read once,
    and a split written under the total's own name (a ``reason`` label on it) is not added."""
    split = "".join(
        f'vllm:num_requests_waiting_by_reason{{engine="{rank}",model_name="m",reason="{why}"}} '
        f"{n}.0\n"
        for rank, why, n in ((0, "capacity", 1), (1, "capacity", 3), (1, "deferred", 1))
    )
    assert parse_gauges(TWO_RANKS + split)["vllm:num_requests_waiting"] == 5.0
    same_name = 'vllm:num_requests_waiting{engine="1",model_name="m",reason="deferred"} 1.0\n'
    assert parse_gauges(TWO_RANKS + same_name)["vllm:num_requests_waiting"] == 5.0
