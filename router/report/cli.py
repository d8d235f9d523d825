"""``carryover report --metrics URL [--metrics URL …] [--since 15m] [--json]``.

Reads every router's ``/metrics`` twice, ``--since`` apart, and reports what happened in
between, merged over the replicas (``--since 0``: one read, everything since the routers
started). Markdown by default, ``--json`` for machines, ``--png FILE`` to draw it too.
"""

from __future__ import annotations

import argparse
import re
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import httpx
import msgspec

from router.report.samples import delta, merge, scrape
from router.report.summary import markdown, summarize

__all__ = ["main", "parse_duration"]

_UNITS = {"": 1.0, "s": 1.0, "m": 60.0, "h": 3600.0}


def parse_duration(text: str) -> float:
    """``90``, ``90s``, ``15m``, ``1h`` in seconds."""
    found = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smh]?)\s*", text)
    if found is None:
        raise argparse.ArgumentTypeError(f"not a duration: {text!r} (e.g. 30s, 15m, 1h)")
    return float(found.group(1)) * _UNITS[found.group(2)]


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="carryover report", description=__doc__)
    p.add_argument(
        "--metrics", action="append", required=True, metavar="URL", help="a router (repeat)"
    )
    p.add_argument("--since", type=parse_duration, default=parse_duration("15m"))
    p.add_argument("--json", action="store_true", help="JSON instead of Markdown")
    p.add_argument("--png", type=Path, metavar="FILE", help="also draw the report there")
    args = p.parse_args(list(sys.argv[1:] if argv is None else argv))
    try:
        first = [scrape(url) for url in args.metrics]
        if args.since > 0:
            time.sleep(args.since)  # the window itself: the report is of what happens in it
            second = [scrape(url) for url in args.metrics]
            gauges = frozenset().union(*(g for _, g in second))
            samples = merge(
                delta(now, before, gauges)
                for (now, _), (before, _) in zip(second, first, strict=True)
            )
        else:
            samples = merge(now for now, _ in first)
    except httpx.HTTPError as exc:
        print(f"carryover report: cannot read metrics: {exc}", file=sys.stderr)
        raise SystemExit(1) from exc
    report = summarize(
        samples, window_s=args.since if args.since > 0 else None, routers=len(args.metrics)
    )
    if args.png is not None:
        from router.report.plot import plot

        plot(report, args.png)
    if args.json:
        data = msgspec.to_builtins(report)
        data["reused_share"] = report.reused_share
        print(msgspec.json.encode(data).decode())
    else:
        print(markdown(report), end="")
