"""The benchmark report's figure: TTFT p50 by turn per arm, and the decoders' KV use over
each arm's run where it was sampled."""

from __future__ import annotations

from pathlib import Path
from typing import Any

__all__ = ["plot"]


def plot(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    decode_kv = {arm: kv.get("samples") for arm, kv in (report.get("decode_kv") or {}).items()}
    with_kv = any(decode_kv.values())
    fig, axes = plt.subplots(
        1, 2 if with_kv else 1, figsize=(14 if with_kv else 8, 4.5), dpi=120, squeeze=False
    )
    ax = axes[0][0]
    for name, arm in report["arms"].items():
        turns = sorted(int(t) for t in arm["turns"])
        values = [(arm["turns"].get(t) or arm["turns"][str(t)])["ttft_p50_ms"] for t in turns]
        ax.plot(turns, values, marker="o" if len(turns) <= 20 else None, label=name)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("turn")
    ax.set_ylabel("TTFT p50 (ms)")
    ax.set_title("Time to first token by turn")
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")
    if with_kv:
        kv_ax = axes[0][1]
        for name, samples in decode_kv.items():
            if samples:
                (line,) = kv_ax.plot(
                    [s[0] for s in samples], [s[1] * 100 for s in samples], label=name
                )
                kv_ax.plot(
                    [s[0] for s in samples],
                    [s[3] * 100 for s in samples],
                    linestyle=":",
                    color=line.get_color(),
                )
        kv_ax.set_xlabel("seconds into the arm")
        kv_ax.set_ylabel("decoders' KV use, mean (%): all (solid), pins (dotted)")
        kv_ax.set_title("Decoders' KV over the run (pins included)")
        kv_ax.grid(alpha=0.3)
        kv_ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
