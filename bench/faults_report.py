"""The fault suite's table: per fault, requests sent, failed, wrong, handles read twice or
left without a final state, and recovery seconds."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import msgspec

__all__ = ["FaultRow", "write_faults_report"]


class FaultRow(msgspec.Struct):
    fault: str
    sent: int
    failed: int  # clean OpenAI-style errors (HTTP or an SSE error event)
    unclean: int  # hangs, cut streams without an error event, non-JSON errors
    wrong: int  # answers that differ from the no-reuse reference
    double_reads: int  # handles read from D after they were used or released
    recovery_seconds: float | None  # fault cleared -> first turn reusing again
    paths: dict[str, int] = {}
    note: str = ""
    unsettled: int = 0  # handles the routers held without a final state once idle


def render(rows: Sequence[FaultRow]) -> str:
    lines = [
        "# Fault suite",
        "",
        "| fault | sent | failed (clean) | unclean | wrong | handles read twice "
        "| handles without a final state | recovery (s) | paths |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        recovery = "-" if row.recovery_seconds is None else f"{row.recovery_seconds:.2f}"
        paths = ", ".join(f"{k} {v}" for k, v in sorted(row.paths.items()))
        lines.append(
            f"| {row.fault} | {row.sent} | {row.failed} | {row.unclean} | {row.wrong} "
            f"| {row.double_reads} | {row.unsettled} | {recovery} | {paths} |"
        )
    notes = [f"* {row.fault}: {row.note}" for row in rows if row.note]
    return "\n".join([*lines, "", *notes, ""])


def write_faults_report(rows: Sequence[FaultRow], folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "faults.json").write_text(
        json.dumps([msgspec.to_builtins(r) for r in rows], indent=2)
    )
    path = folder / "faults.md"
    path.write_text(render(rows))
    return path
