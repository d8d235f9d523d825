"""``carryover report (--metrics URL … | --prometheus URL) [--since 15m] [--watch]``.

From the routers themselves: reads every router's ``/metrics`` twice, ``--since`` apart, and
reports what happened in between, merged over the replicas (``--since 0``: one read,
everything since the routers started). From a Prometheus server that scrapes them: the same
report of the last ``--since``, at once. ``--watch`` prints one report per window until
stopped (``--count N``: N of them). Markdown by default, ``--json`` for machines (one line per
report), ``--png FILE`` to draw it too. A router with api keys, or listening beyond loopback,
serves ``/metrics`` to its admin key: the report sends ``CARRYOVER_ADMIN_KEY`` (or the file
``CARRYOVER_ADMIN_KEY_FILE`` names).
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import httpx
import msgspec

from carryover.router.report.prometheus import PrometheusError, window
from carryover.router.report.samples import Samples, delta, merge, scrape
from carryover.router.report.summary import Report, markdown, summarize

__all__ = ["Unreadable", "main", "parse_duration"]

_UNITS = {"": 1.0, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}


class Unreadable(Exception):
    """A router's ``/metrics`` could not be read; ``url`` names it."""

    def __init__(self, url: str, cause: Exception) -> None:
        super().__init__(f"cannot read {url}: {cause}")
        self.url = url


def parse_duration(text: str) -> float:
    """``90``, ``90s``, ``15m``, ``1h``, ``1d`` in seconds."""
    found = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smhd]?)\s*", text)
    if found is None:
        raise argparse.ArgumentTypeError(f"not a duration: {text!r} (e.g. 30s, 15m, 1h, 1d)")
    return float(found.group(1)) * _UNITS[found.group(2)]


def _admin_key() -> str | None:
    """The routers' admin key, from the variables the router reads it from: a router with
    api keys, or beyond loopback, serves its metrics to operators only."""
    path = os.environ.get("CARRYOVER_ADMIN_KEY_FILE")
    if path:
        return Path(path).read_text().strip() or None
    return os.environ.get("CARRYOVER_ADMIN_KEY") or None


def _read(url: str) -> tuple[Samples, frozenset[str]]:
    try:
        return scrape(url, admin_key=_admin_key())
    except (httpx.HTTPError, OSError) as exc:
        raise Unreadable(url, exc) from exc


def _say(text: str) -> None:
    """What the report is doing, on stderr (stdout holds the report, JSON perhaps)."""
    print(f"carryover report: {text}", file=sys.stderr, flush=True)


def _check_targets(urls: list[str], scrapes: list[tuple[Samples, frozenset[str]]]) -> None:
    for url, (samples, _) in zip(urls, scrapes, strict=True):
        if not any(name.startswith("carryover_") for name, _ in samples):
            _say(f"warning: {url} exposes no carryover metrics: is it a carryover router?")


def _from_routers(
    urls: list[str], since: float, watch: bool, sleep: Callable[[float], None]
) -> Iterator[Report]:
    earlier = [_read(url) for url in urls]
    _check_targets(urls, earlier)
    if since <= 0:
        yield summarize(merge(now for now, _ in earlier), window_s=None, routers=len(urls))
        return
    while True:
        _say(
            f"read {len(urls)} router(s); the report is of the next {_spoken(since)} "
            "(--since 0: at once, since the routers started)"
        )
        sleep(since)  # the window itself: the report is of what happens in it
        later = [_read(url) for url in urls]
        gauges = frozenset().union(*(g for _, g in later))
        samples: Samples = merge(
            delta(now, before, gauges) for (now, _), (before, _) in zip(later, earlier, strict=True)
        )
        yield summarize(samples, window_s=since, routers=len(urls))
        if not watch:
            return
        earlier = later


def _spoken(seconds: float) -> str:
    for unit, size in (("d", 86400.0), ("h", 3600.0), ("m", 60.0)):
        if seconds >= size and seconds % size == 0:
            return f"{seconds / size:g}{unit}"
    return f"{seconds:g}s"


def _from_prometheus(
    url: str, match: str, since: float, watch: bool, sleep: Callable[[float], None]
) -> Iterator[Report]:
    while True:
        found = window(url, since, match=match)
        yield summarize(found.samples, window_s=since or None, routers=found.routers)
        if not watch:
            return
        sleep(since)


def _show(report: Report, args: argparse.Namespace, first: bool) -> None:
    if args.png is not None:
        from carryover.router.report.plot import plot

        plot(report, args.png)
    if args.json:
        data = msgspec.to_builtins(report)
        data["reused_share"] = report.reused_share
        print(msgspec.json.encode(data).decode(), flush=True)
    else:
        if not first:
            print("\x1b[2J\x1b[H" if sys.stdout.isatty() else "", end="")
        print(markdown(report), end="", flush=True)


def main(argv: Sequence[str] | None = None, *, sleep: Callable[[float], None] = time.sleep) -> None:
    """``sleep`` waits out a window (injected by tests)."""
    p = argparse.ArgumentParser(prog="carryover report", description=__doc__)
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--metrics", action="append", metavar="URL", help="a router (repeat)")
    source.add_argument(
        "--prometheus", metavar="URL", help="a Prometheus server that scrapes the routers"
    )
    p.add_argument(
        "--match",
        default="",
        metavar="MATCHERS",
        help='with --prometheus: label matchers of the fleet\'s series, e.g. job="carryover"',
    )
    p.add_argument(
        "--since",
        type=parse_duration,
        default=parse_duration("15m"),
        help="the window: 30s, 15m, 1h, 1d (default 15m; 0: everything since the routers "
        "started, at once)",
    )
    p.add_argument("--watch", action="store_true", help="a new report every --since")
    p.add_argument("--count", type=int, metavar="N", help="with --watch: stop after N reports")
    p.add_argument("--json", action="store_true", help="JSON instead of Markdown")
    p.add_argument("--png", type=Path, metavar="FILE", help="also draw the report there")
    args = p.parse_args(list(sys.argv[1:] if argv is None else argv))
    if args.watch and args.since <= 0:
        p.error("--watch needs a window: --since 30s, say")
    if args.count is not None and (not args.watch or args.count < 1):
        p.error("--count N goes with --watch, N ≥ 1")
    if args.match and not args.prometheus:
        p.error("--match goes with --prometheus")
    reports = (
        _from_prometheus(args.prometheus, args.match, args.since, args.watch, sleep)
        if args.prometheus
        else _from_routers(args.metrics, args.since, args.watch, sleep)
    )
    shown = 0
    try:
        for report in reports:
            _show(report, args, first=shown == 0)
            shown += 1
            if args.count is not None and shown >= args.count:
                break
    except Unreadable as exc:
        _say(str(exc))
        raise SystemExit(1) from exc
    except httpx.HTTPError as exc:
        _say(f"cannot read {args.prometheus}: {exc}")
        raise SystemExit(1) from exc
    except PrometheusError as exc:
        _say(f"Prometheus at {args.prometheus} refused the query: {exc}")
        raise SystemExit(1) from exc
    except KeyboardInterrupt:  # the way out of --watch
        return
