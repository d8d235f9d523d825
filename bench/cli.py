"""``carryover bench``: the multi-turn benchmark, the router overhead harness, the simulator's
own throughput."""

from __future__ import annotations

import argparse
import signal
import sys
from collections.abc import Sequence
from pathlib import Path
from types import FrameType

from carryover.bench.lifetimes import Lifetimes
from carryover.bench.multiturn import ARMS, run_arms
from carryover.bench.placement import parse_cpus
from carryover.bench.report import Slo, render_markdown
from carryover.bench.workload import Distribution, WorkloadSpec, generate, read_conversations


def _multiturn(args: argparse.Namespace) -> None:
    if args.input:
        conversations = read_conversations(
            args.input, output_tokens=int(args.output_tokens.value), limit=args.conversations
        )
    else:
        conversations = generate(
            WorkloadSpec(
                conversations=args.conversations,
                turns=args.turns,
                system_tokens=args.system_tokens,
                user_tokens=args.user_tokens,
                output_tokens=args.output_tokens,
                think_time=args.think_time,
                reasoning_share=args.reasoning_share,
                edit_probability=args.edit_probability,
                arrival=args.arrival,
                rate=args.rate,
                seed=args.seed,
                shared_system=args.shared_system,
            )
        )
    targets = dict(t.split("=", 1) for t in args.target)
    report = run_arms(
        conversations,
        [] if args.arms == "none" else args.arms.split(","),
        out=args.out,
        slo=Slo.parse(args.slo),
        prefills=args.prefills,
        decodes=args.decodes,
        speed=args.speed,
        targets=targets,
        model=args.model,
        lifetimes=Lifetimes(args.decode_ttl) if args.decode_ttl else None,
        progress=sys.stderr.isatty(),
        meta={k: str(v) for k, v in vars(args).items() if k not in ("func", "target")},
    )
    print(render_markdown(report))
    print(f"written to {args.out}")


def _cpus(text: str) -> frozenset[int]:
    try:
        return parse_cpus(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _fleet(args: argparse.Namespace) -> None:
    from carryover.bench.fleet import run_fleet

    report = run_fleet(
        args.workload,
        answer_tokens=args.answer_tokens,
        arms=args.arms.split(","),
        out=args.out,
        slo=Slo.parse(args.slo),
        prefills=args.prefills,
        decodes=args.decodes,
        time_scale=args.time_scale,
        engine_speed=args.engine_speed,
        conversations=args.conversations,
        turns=args.turns,
        rate=args.rate,
        num_blocks=args.num_blocks,
        seed=args.seed,
        stream_interval=args.stream_interval,
        engine_nice=args.engine_nice,
        router_cpus=args.router_cpus,
        progress=sys.stderr.isatty(),
    )
    print(render_markdown(report))
    print(f"written to {args.out}")


def _overhead(args: argparse.Namespace) -> None:
    from carryover.bench.overhead import parse_peer, run_overhead

    run_overhead(
        args.out,
        requests=args.requests,
        concurrency=args.concurrency,
        modes=args.modes,
        peers=[parse_peer(text) for text in args.peer],
        redis=not args.no_redis,
        workers=args.workers,
        prefill_port=args.prefill_port,
        decode_port=args.decode_port,
        rounds=args.rounds,
    )


def _instructions(args: argparse.Namespace) -> None:
    from carryover.bench.instructions import render_instructions, run_instructions

    results = run_instructions(args.out, modes=args.modes, turns=args.turns, redis=args.redis)
    print(render_instructions(results))


def _replicas(args: argparse.Namespace) -> None:
    from carryover.bench.replicas import render, run_replicas

    conversations = generate(
        WorkloadSpec(
            conversations=args.conversations,
            turns=args.turns,
            user_tokens=args.user_tokens,
            output_tokens=args.output_tokens,
            seed=args.seed,
        )
    )
    rows = run_replicas(
        conversations, args.out, routers=args.routers, stores=args.stores, speed=args.speed
    )
    print(render(rows))
    print(f"written to {args.out}")


def _ints(text: str) -> list[int]:
    return [int(part) for part in text.split(",")]


def _sim_throughput(args: argparse.Namespace) -> None:
    from carryover.bench.sim_bench import run_sim_bench

    run_sim_bench(args.out, requests=args.requests, concurrency=args.concurrency)


def _tenant_salt(args: argparse.Namespace) -> None:
    from carryover.bench.tenant_salt import run_tenant_salt

    run_tenant_salt(
        args.out,
        tenants=args.tenants,
        per_tenant=args.per_tenant,
        system_tokens=args.system_tokens,
        speed=args.speed,
    )


def _soak(args: argparse.Namespace) -> None:
    if not args.churn:
        from carryover.bench import soak

        soak.main(["--minutes", str(args.minutes), "--out", str(args.out)])
        return
    import dataclasses
    import json

    from carryover.bench.churn import ChurnPlan, render_churn, run_churn

    plan = ChurnPlan.short() if args.short else ChurnPlan()
    if args.seconds is not None:
        plan = dataclasses.replace(plan, seconds=args.seconds)
    report = run_churn(dataclasses.replace(plan, seed=args.seed))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "churn.json").write_text(json.dumps(report, indent=2))
    (args.out / "churn.md").write_text(render_churn(report) + "\n")
    print(render_churn(report))
    print(f"written to {args.out}")
    if report["grown"]:
        raise SystemExit(1)


def _gpu(args: argparse.Namespace) -> None:
    from carryover.bench.gpu import payload, plan

    root = Path.cwd()
    folder = root / args.folder
    if args.action == "payload":
        for part in payload.build(folder):
            size = sum(f.stat().st_size for f in part.iterdir()) / payload.MIB
            print(f"{part.relative_to(root)}: {size:.1f} MiB")
        return
    parts = sorted((folder / "parts").glob("part-*"), key=lambda p: int(p.name.split("-")[1]))
    if not parts:
        raise SystemExit(f"no parts in {folder / 'parts'}: run carryover bench gpu payload first")
    calls = plan.plan(
        parts,
        root=root,
        sizes=args.sizes,
        peer=args.peer,
        prefill_gpu=args.prefill_gpu,
        decode_gpu=args.decode_gpu,
    )
    print(plan.render(calls))


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="carryover bench")
    sub = parser.add_subparsers(dest="command", required=True)
    m = sub.add_parser("multiturn", help="turn-N vs turn-1 TTFT across arms")
    m.add_argument(
        "--arms",
        default="carryover,carryover-no-reuse,carryover-unchecked,colocated",
        help=f"comma-separated, of {', '.join(ARMS)} (or 'none' with --target)",
    )
    m.add_argument(
        "--target",
        action="append",
        default=[],
        metavar="NAME=URL",
        help="an extra arm already running (e.g. a router in front of real vLLM)",
    )
    m.add_argument("--conversations", type=int, default=16)
    m.add_argument("--turns", type=int, default=10)
    m.add_argument(
        "--system-tokens", type=Distribution.parse, default=Distribution("constant", 200)
    )
    m.add_argument("--user-tokens", type=Distribution.parse, default=Distribution("constant", 800))
    m.add_argument(
        "--output-tokens", type=Distribution.parse, default=Distribution("constant", 200)
    )
    m.add_argument(
        "--think-time", type=Distribution.parse, default=Distribution("constant", 0), help="ms"
    )
    m.add_argument("--reasoning-share", type=float, default=0.0)
    m.add_argument(
        "--shared-system",
        action="store_true",
        help="every conversation opens with the same system prompt",
    )
    m.add_argument("--edit-probability", type=float, default=0.0)
    m.add_argument("--arrival", choices=["closed", "poisson"], default="poisson")
    m.add_argument("--rate", type=float, default=4.0, help="new conversations per second (poisson)")
    m.add_argument("--seed", type=int, default=0)
    m.add_argument("--input", type=Path, help="generate_multi_turn.json-style or ShareGPT JSON")
    m.add_argument("--prefills", type=int, default=2)
    m.add_argument("--decodes", type=int, default=2)
    m.add_argument("--speed", type=float, default=1.0, help="simulated delay multiplier")
    m.add_argument("--model", default="sim-qwen3")
    m.add_argument(
        "--decode-ttl",
        type=float,
        help="D's decoder_kv_blocks_ttl in seconds (router told too): below --think-time, "
        "every handle expires between turns",
    )
    m.add_argument("--slo", default="ttft=2000ms,itl=50ms")
    m.add_argument("--out", type=Path, default=Path("results/multiturn"))
    m.set_defaults(func=_multiturn)
    from carryover.bench.fleet import ARMS as FLEET_ARMS
    from carryover.bench.fleet import PRESETS

    f = sub.add_parser("fleet", help="one simulated fleet, every router in the same run")
    f.add_argument("--workload", choices=sorted(PRESETS), required=True)
    f.add_argument("--answer-tokens", type=int, default=60, help="about 60, 600 or 2000")
    f.add_argument("--arms", default=",".join(FLEET_ARMS), help="comma-separated")
    f.add_argument("--prefills", type=int, default=4)
    f.add_argument("--decodes", type=int, default=4)
    f.add_argument("--num-blocks", type=int, help="KV capacity per instance (default: preset)")
    f.add_argument(
        "--time-scale",
        type=float,
        default=0.02,
        help="think times, arrival gaps and D's TTL times this",
    )
    f.add_argument(
        "--engine-speed",
        type=float,
        default=0.2,
        help="the engines' simulated timing (and the SLO) times this",
    )
    f.add_argument("--conversations", type=int, help="default: the preset's")
    f.add_argument("--turns", type=int, help="default: the preset's")
    f.add_argument("--rate", type=float, help="new conversations per simulated second")
    f.add_argument("--seed", type=int, default=0)
    f.add_argument(
        "--stream-interval",
        type=int,
        default=10,
        help="the engines' --stream-interval (vLLM's): tokens per streamed chunk after the first",
    )
    f.add_argument(
        "--slo",
        default="ttft=1000ms,itl=250ms",
        help="in simulated time (scaled like the rest); ITL is per streamed chunk",
    )
    f.add_argument(
        "--engine-nice",
        type=int,
        default=10,
        help="niceness of the simulated engines: the routers and the load generator get the "
        "CPU first, as on a fleet where engines have hosts of their own (0: all equal)",
    )
    f.add_argument(
        "--router-cpus",
        type=_cpus,
        default=frozenset(),
        help="CPUs (taskset's list, e.g. 1) of each arm's router, its workers included; the "
        "engines and the load generator run on the others (default: all share every CPU)",
    )
    f.add_argument("--out", type=Path, default=Path("results/fleet"))
    f.set_defaults(func=_fleet)
    o = sub.add_parser("overhead", help="router cost per turn against direct engine calls")
    o.add_argument(
        "--peer",
        action="append",
        default=[],
        metavar="NAME=URL|NAME=COMMAND",
        help="another router in the same run: a URL already in front of --prefill-port and "
        "--decode-port, or a command started here ({port}, {prefill}, {decode} filled in)",
    )
    o.add_argument(
        "--modes", type=lambda t: t.split(","), default=["completions", "stream", "chat"]
    )
    o.add_argument("--concurrency", type=_ints, default=[1, 64])
    o.add_argument("--requests", type=_ints, default=[1000, 6000], help="turns per concurrency")
    o.add_argument("--workers", type=_ints, default=[1], help="Redis arms: uvicorn workers")
    o.add_argument("--no-redis", action="store_true", help="in-process state only")
    o.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="measure every arm this many times, in turns; report medians",
    )
    o.add_argument("--prefill-port", type=int, help="fixed port of the simulated P")
    o.add_argument("--decode-port", type=int, help="fixed port of the simulated D")
    o.add_argument("--out", type=Path, default=Path("results/overhead"))
    o.set_defaults(func=_overhead)
    i = sub.add_parser("instructions", help="router instructions per turn, counted by callgrind")
    i.add_argument(
        "--modes", type=lambda t: t.split(","), default=["completions", "stream", "chat"]
    )
    i.add_argument("--turns", type=int, default=300, help="measured turns per mode")
    i.add_argument("--redis", action="store_true", help="Redis state (a local redis-server)")
    i.add_argument("--out", type=Path, default=Path("results/instructions"))
    i.set_defaults(func=_instructions)
    r = sub.add_parser("replicas", help="one workload through 1, 2, 4, 8 router processes")
    r.add_argument("--routers", type=_ints, default=[1, 2, 4, 8])
    r.add_argument("--stores", type=lambda t: t.split(","), default=["redis", "cluster", "memory"])
    r.add_argument("--conversations", type=int, default=32)
    r.add_argument("--turns", type=int, default=6)
    r.add_argument("--user-tokens", type=Distribution.parse, default=Distribution("constant", 300))
    r.add_argument("--output-tokens", type=Distribution.parse, default=Distribution("constant", 40))
    r.add_argument("--speed", type=float, default=1.0, help="simulated delay multiplier")
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--out", type=Path, default=Path("results/replicas"))
    r.set_defaults(func=_replicas)
    s = sub.add_parser("sim", help="requests/s one simulated instance serves with delays off")
    s.add_argument("--requests", type=int, default=5000)
    s.add_argument("--concurrency", type=int, default=64)
    s.add_argument("--out", type=Path, default=Path("results/sim"))
    s.set_defaults(func=_sim_throughput)
    k = sub.add_parser("soak", help="what the router keeps and spends over time, under churn")
    k.add_argument(
        "--churn",
        action="store_true",
        help="DNS churn, DELETE floods, large tool lists, abandoned conversations "
        "(bench/churn.py); without: two routers over Redis (bench/soak.py)",
    )
    k.add_argument("--short", action="store_true", help="the churn soak's CI version")
    k.add_argument("--seconds", type=float, help="the churn soak's measured seconds")
    k.add_argument("--minutes", type=float, default=10.0, help="the conversation soak's length")
    k.add_argument("--seed", type=int, default=0)
    k.add_argument("--out", type=Path, default=Path("results/soak"))
    k.set_defaults(func=_soak)
    t = sub.add_parser("tenant-salt", help="what a cache salt per tenant costs")
    t.add_argument("--tenants", type=int, default=8)
    t.add_argument("--per-tenant", type=int, default=4, help="first turns per tenant")
    t.add_argument("--system-tokens", type=int, default=2000, help="the shared system prompt")
    t.add_argument("--speed", type=float, default=1.0, help="simulated delay multiplier")
    t.add_argument("--out", type=Path, default=Path("results/tenant-salt"))
    t.set_defaults(func=_tenant_salt)
    g = sub.add_parser("gpu", help="the run on a lent GPU machine: its payload and its calls")
    g.add_argument(
        "action",
        choices=["payload", "plan"],
        help="payload: download, slim and cut the wheels into parts; plan: the device calls",
    )
    g.add_argument(
        "--folder",
        type=Path,
        default=Path(".gpu"),
        help="in the repository, ignored by git: wheels, blobs, parts",
    )
    g.add_argument(
        "--sizes",
        default="8000x4,16000x4,32000x4",
        help="conversations growing to TOKENS, xN of them at once",
    )
    g.add_argument("--peer", default="vllm-router:consistent_hash")
    g.add_argument("--prefill-gpu", default="0", help="CUDA_VISIBLE_DEVICES of P")
    g.add_argument("--decode-gpu", default="0", help="CUDA_VISIBLE_DEVICES of D")
    g.set_defaults(func=_gpu)
    args = parser.parse_args(sys.argv[1:] if argv is None else list(argv))
    # SIGTERM's default action ends the process at once, skipping the ``finally`` that stops
    # the engines and routers a benchmark started (they run in sessions of their own, so
    # nothing else would); as an exception, it unwinds through them.
    signal.signal(signal.SIGTERM, _unwind)
    args.func(args)


def _unwind(signum: int, frame: FrameType | None) -> None:
    raise SystemExit(128 + signum)
