"""Simulator settings, read from the same flags ``vllm serve`` takes (plus ``--sim-*`` knobs)."""

from __future__ import annotations

import argparse
import json
import os
import uuid
from collections.abc import Sequence
from typing import Any

import msgspec

from carryover.bench.lifetimes import VLLM_EXPIRY_MARGIN
from carryover.bench.sim.kv_events import KVEventsSettings
from carryover.bench.sim.timing import Timing

__all__ = ["KVTransferConfig", "SimConfig", "parse_sim_args"]


class KVConnectorExtra(msgspec.Struct, frozen=True):
    """``kv_connector_extra_config`` keys the simulator honours (vLLM defaults)."""

    bidirectional_kv_xfer: bool = False
    kv_recompute_threshold: int = 64
    decoder_kv_blocks_ttl: float = 480.0
    kv_lease_duration: float = 30.0


class KVTransferConfig(msgspec.Struct, frozen=True):
    kv_connector: str | None = None
    kv_role: str | None = None
    kv_load_failure_policy: str = "fail"
    engine_id: str | None = None
    kv_buffer_device: str | None = None
    kv_connector_extra_config: KVConnectorExtra = KVConnectorExtra()

    def __post_init__(self) -> None:
        if self.kv_load_failure_policy not in ("fail", "recompute"):
            raise ValueError("kv_load_failure_policy must be 'fail' or 'recompute'")
        if self.kv_role not in (None, "kv_producer", "kv_consumer", "kv_both"):
            raise ValueError("kv_role must be kv_producer, kv_consumer or kv_both")


class SimConfig(msgspec.Struct, kw_only=True):
    """One simulated instance."""

    model: str
    served_model_name: str
    host: str = "127.0.0.1"
    port: int = 8000
    block_size: int = 16
    num_blocks: int = 32768
    max_num_seqs: int = 256
    max_model_len: int = 32768
    # vLLM's --stream-interval: a stream sends its first token at once, then every this many
    # tokens and at the end (vllm/v1/engine/output_processor.py).
    stream_interval: int = 1
    enable_prefix_caching: bool = True
    kv_transfer: KVTransferConfig | None = None
    kv_events: KVEventsSettings | None = None  # None: no events (vLLM's default)
    side_channel_host: str = "localhost"
    side_channel_port: int = 5600
    vllm_version: str = "0.33.0"
    # --tokens-only: /inference/v1/generate alone (the OpenAI generation endpoints answer 404).
    tokens_only: bool = False
    noncanonical_outputs: bool = False
    timing: Timing = Timing()
    error_rate: float = 0.0
    hang: bool = False
    slow: float = 0.0
    seed: int = 0
    warm_tier: str | None = None  # URL of a shared simulated warm tier (bench/sim/warm_tier.py)
    # P declines a read of D's blocks this close to D's deadline: vLLM's
    # _KV_BLOCKS_EXPIRY_SAFETY_MARGIN (docs/vllm-protocol.md §4); a benchmark scaling D's TTL
    # scales it too.
    expiry_margin: float = VLLM_EXPIRY_MARGIN

    @property
    def bidirectional(self) -> bool:
        return bool(
            self.kv_transfer and self.kv_transfer.kv_connector_extra_config.bidirectional_kv_xfer
        )

    @property
    def extra(self) -> KVConnectorExtra:
        return (
            self.kv_transfer.kv_connector_extra_config if self.kv_transfer else KVConnectorExtra()
        )

    @property
    def failure_policy(self) -> str:
        return self.kv_transfer.kv_load_failure_policy if self.kv_transfer else "fail"

    def new_engine_id(self) -> str:
        fixed = self.kv_transfer.engine_id if self.kv_transfer else None
        return fixed or str(uuid.uuid4())

    @property
    def streams_handles(self) -> bool:
        """Streamed responses carry ``kv_transfer_params`` from vLLM 0.33.0 on."""
        major, minor = (int(x) for x in self.vllm_version.split(".")[:2])
        return (major, minor) >= (0, 33)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="carryover sim", description="A simulated vLLM instance.")
    p.add_argument("model")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--served-model-name", nargs="+")
    p.add_argument("--kv-transfer-config", type=json.loads)
    p.add_argument("--kv-events-config", type=json.loads)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-model-len", type=int, default=32768)
    p.add_argument("--stream-interval", type=int, default=1)
    p.add_argument("--enable-prefix-caching", dest="prefix_caching", action="store_true")
    p.add_argument("--no-enable-prefix-caching", dest="prefix_caching", action="store_false")
    p.set_defaults(prefix_caching=True)
    # Accepted so that a vLLM launch line runs unchanged; they change nothing here.
    for flag in ("--dtype", "--load-format", "--gpu-memory-utilization", "--tensor-parallel-size"):
        p.add_argument(flag)
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--tokens-only", action="store_true")
    p.add_argument("--sim-num-blocks", type=int, default=32768, help="KV capacity in blocks")
    p.add_argument("--sim-speed", type=float, default=1.0, help="delay multiplier (0: none)")
    p.add_argument("--sim-timing", type=json.loads, default={}, help="Timing fields as JSON")
    p.add_argument("--sim-vllm-version", default="0.33.0")
    p.add_argument("--sim-noncanonical-outputs", action="store_true")
    p.add_argument("--sim-error-rate", type=float, default=0.0)
    p.add_argument("--sim-hang", action="store_true")
    p.add_argument("--sim-slow", type=float, default=0.0, help="seconds added to every request")
    p.add_argument("--sim-seed", type=int, default=0)
    p.add_argument("--sim-warm-tier", metavar="URL", help="a carryover sim-warm-tier to share")
    p.add_argument(
        "--sim-expiry-margin",
        type=float,
        default=VLLM_EXPIRY_MARGIN,
        help="seconds before D's deadline a read is declined (vLLM: 5)",
    )
    return p


def parse_sim_args(argv: Sequence[str], environ: dict[str, str] | None = None) -> SimConfig:
    env = os.environ if environ is None else environ
    args = _parser().parse_args(list(argv))
    kv: KVTransferConfig | None = None
    if args.kv_transfer_config is not None:
        kv = msgspec.convert(args.kv_transfer_config, KVTransferConfig)
    events: KVEventsSettings | None = None
    if args.kv_events_config is not None:
        events = msgspec.convert(args.kv_events_config, KVEventsSettings)
        if not events.enable_kv_cache_events or events.publisher == "null":
            events = None
    timing_fields: dict[str, Any] = {"speed": args.sim_speed, **args.sim_timing}
    return SimConfig(
        model=args.model,
        served_model_name=(args.served_model_name or [args.model])[0],
        host=args.host,
        port=args.port,
        block_size=args.block_size,
        num_blocks=args.sim_num_blocks,
        max_num_seqs=args.max_num_seqs,
        max_model_len=args.max_model_len,
        stream_interval=max(1, args.stream_interval),
        enable_prefix_caching=args.prefix_caching,
        kv_transfer=kv,
        kv_events=events,
        side_channel_host=env.get("VLLM_NIXL_SIDE_CHANNEL_HOST", "localhost"),
        side_channel_port=int(env.get("VLLM_NIXL_SIDE_CHANNEL_PORT", "5600")),
        vllm_version=args.sim_vllm_version,
        tokens_only=args.tokens_only,
        noncanonical_outputs=args.sim_noncanonical_outputs,
        timing=msgspec.convert(timing_fields, Timing),
        error_rate=args.sim_error_rate,
        hang=args.sim_hang,
        slow=args.sim_slow,
        seed=args.sim_seed,
        warm_tier=args.sim_warm_tier,
        expiry_margin=args.sim_expiry_margin,
    )
