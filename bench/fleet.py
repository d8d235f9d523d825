"""``carryover bench fleet``: one simulated fleet, one workload (same seed, same arrival and
think times), every arm in turn on fresh engines: carryover's arms and the routers users
would run instead (vLLM Router's P/D policies, bench/peers.py), and a plain P/D proxy
(carryover without conversation state).

Time is scaled so that a run fits in minutes here, by two factors the report states:
``--time-scale`` multiplies think times, arrival gaps, D's ``decoder_kv_blocks_ttl`` and P's
margin before it (the router is told the same, with no queue margin: bench/lifetimes.py); ``--engine-speed`` multiplies the engines'
simulated timing and the SLO. One factor for both would make a turn's engine work shorter
than the router's and the simulators' own Python time on two cores, and the comparison would
measure that instead; engine work kept within about 5x of real keeps it the larger part."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec

from carryover.bench.lifetimes import Lifetimes
from carryover.bench.multiturn import run_arms
from carryover.bench.peers import POLICIES
from carryover.bench.placement import Placement
from carryover.bench.report import Slo
from carryover.bench.workload import Distribution, WorkloadSpec, generate

__all__ = ["ARMS", "PRESETS", "Preset", "run_fleet"]

#: Every arm of a fleet run, in the order they run.
ARMS = (
    "carryover",
    "carryover-always-pull",  # pulls priced at nothing (docs/turn-costs.md)
    "carryover-no-index",
    "carryover-decode-local",
    "carryover-warm",
    "carryover-workers",  # two worker processes, state in a redis-server of the arm's own
    "carryover-no-reuse",  # the plain P/D proxy: load only, no conversation state
    *(f"vllm-router:{policy}" for policy in POLICIES),
)


class Preset(msgspec.Struct, frozen=True):
    """A named workload and the fleet it runs on, before time scaling."""

    about: str
    conversations: int
    turns: int
    max_turns: int
    system_tokens: Distribution
    user_tokens: Distribution
    think_ms: Distribution
    reasoning_share: float
    arrival: str
    rate: float
    num_blocks: int  # KV capacity of each instance, in blocks of 16 tokens
    decode_ttl: float = 480.0  # D's decoder_kv_blocks_ttl, seconds
    tool_results: bool = False
    stream: bool = True
    max_model_len: int = 32768


CHAT = Preset(
    about="chat: long shared system prompts, log-normal think times with a tail past "
    "D's TTL, a quarter on a reasoning template whose thinking later turns strip",
    conversations=500,
    turns=8,
    max_turns=20,
    system_tokens=Distribution("constant", 1000),
    user_tokens=Distribution("lognormal", 150, sigma=0.6),
    # A median of 20 s, one in twenty past D's 480 s, none past 720 s.
    think_ms=Distribution("lognormal", 20_000, high=720_000, sigma=1.9),
    reasoning_share=0.25,
    arrival="poisson",
    rate=8.0,
    num_blocks=32768,
    # 20 turns of 2,000-token answers reach ~45k tokens: a long-context model's window.
    max_model_len=65536,
)


PRESETS: dict[str, Preset] = {
    "chat": CHAT,
    "agent": Preset(
        about="agent: concurrent sessions of 30-36 turns answered whole, each after the "
        "first a tool's result of 50-2,000 tokens (role tool), gaps of 0.2-5 s, contexts "
        "growing past 30k tokens",
        conversations=64,
        turns=30,
        max_turns=36,
        system_tokens=Distribution("constant", 2000),
        user_tokens=Distribution("uniform", low=50, high=2000),
        think_ms=Distribution("uniform", low=200, high=5000),
        reasoning_share=0.0,
        arrival="closed",
        rate=64.0,
        num_blocks=65536,
        tool_results=True,
        stream=False,
        max_model_len=131072,
    ),
    "pressure": msgspec.structs.replace(
        CHAT,
        about="pressure: chat on decoders of 4,096 blocks, which the pins of 40 "
        "conversations alone could fill to three quarters",
        rate=16.0,
        num_blocks=4096,
    ),
}


def _scaled(d: Distribution, factor: float) -> Distribution:
    if factor == 0:
        return Distribution("constant", 0)
    return msgspec.structs.replace(
        d, value=d.value * factor, low=d.low * factor, high=d.high * factor
    )


def run_fleet(
    workload: str,
    *,
    answer_tokens: int,
    arms: list[str],
    out: Path,
    slo: Slo,
    prefills: int = 4,
    decodes: int = 4,
    time_scale: float = 0.05,
    engine_speed: float | None = None,
    conversations: int | None = None,
    turns: int | None = None,
    rate: float | None = None,
    num_blocks: int | None = None,
    seed: int = 0,
    stream_interval: int = 10,
    engine_nice: int = 0,
    router_cpus: frozenset[int] = frozenset(),
    progress: bool = False,
) -> dict[str, Any]:
    preset = PRESETS[workload]
    placement = Placement(engine_nice=engine_nice, router_cpus=router_cpus)
    speed = time_scale if engine_speed is None else engine_speed
    spec = WorkloadSpec(
        conversations=conversations or preset.conversations,
        turns=turns or preset.turns,
        max_turns=0 if turns else preset.max_turns,
        system_tokens=preset.system_tokens,
        user_tokens=preset.user_tokens,
        output_tokens=Distribution("constant", answer_tokens),
        think_time=_scaled(preset.think_ms, time_scale),
        reasoning_share=preset.reasoning_share,
        arrival=preset.arrival,
        # Arrivals per second of scaled time; time_scale 0 (engines without delays): at once.
        rate=(rate or preset.rate) / time_scale if time_scale > 0 else 1e9,
        seed=seed,
        shared_system=True,
        tool_results=preset.tool_results,
        stream=preset.stream,
    )
    blocks = num_blocks or preset.num_blocks
    meta = {
        "workload": workload,
        "about": preset.about,
        "answer_tokens": answer_tokens,
        "fleet": f"{prefills} P + {decodes} D, {blocks} KV blocks each, "
        f"--stream-interval {stream_interval}",
        "time_scale": f"{time_scale} (think times, arrival gaps, D's TTL, P's expiry margin "
        "and the router's lifetimes)",
        "engine_speed": f"{speed} (the engines' simulated timing, and the SLO {slo.describe()})",
        "engine_nice": engine_nice,
        "placement": placement.describe(),
        "spec": msgspec.json.encode(spec).decode(),
    }
    return run_arms(
        generate(spec),
        arms,
        out=out,
        slo=slo.scaled(speed) if speed > 0 else slo,
        prefills=prefills,
        decodes=decodes,
        speed=speed,
        sim_flags=[
            "--sim-num-blocks",
            str(blocks),
            "--max-model-len",
            str(preset.max_model_len),
            "--stream-interval",
            str(stream_interval),
        ],
        progress=progress,
        meta=meta,
        # time_scale 0 (engines without delays): vLLM's own lifetimes.
        lifetimes=Lifetimes.scaled(preset.decode_ttl, time_scale) if time_scale > 0 else None,
        placement=placement,
    )
