"""``carryover report --png``: the report's panels as one image, drawn like the benchmark's
plot (matplotlib, from the ``bench`` extra; the router itself never needs it)."""

from __future__ import annotations

from pathlib import Path

from carryover.router.report.summary import Report

__all__ = ["plot"]


def plot(report: Report, path: Path) -> None:
    try:
        import matplotlib
    except ImportError as exc:  # the runtime environment has no plotting
        raise SystemExit(
            "carryover report --png needs matplotlib: pip install 'carryover[bench]'"
        ) from exc
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ttft, paths, held) = plt.subplots(1, 3, figsize=(15, 4.5), dpi=110)
    turns = [row.turns for row in report.ttft]
    for label, values in (
        ("p50", [row.p50_ms for row in report.ttft]),
        ("p99", [row.p99_ms for row in report.ttft]),
    ):
        ttft.plot(turns, [v if v is not None else float("nan") for v in values], "o-", label=label)
    ttft.set_title("Time to first token by turn (streamed)")
    ttft.set_xlabel("turns")
    ttft.set_ylabel("ms")
    ttft.grid(alpha=0.3)
    ttft.legend()
    names = list(report.turns_by_path)
    paths.barh(names, [report.turns_by_path[n] for n in names])
    share = report.reused_share
    paths.set_title(
        "Turns by path" + ("" if share is None else f" (prompt tokens reused: {share:.0%})")
    )
    instances = list(report.decode_held)
    held.bar(instances, [report.decode_held[i].handles for i in instances])
    held.set_title("Handles held per decode instance")
    held.tick_params(axis="x", labelrotation=20)
    window = "since start" if report.window_s is None else f"last {report.window_s:g} s"
    fig.suptitle(f"carryover: {report.routers} router(s), {window}")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
