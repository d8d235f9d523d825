"""The report's sections on where each arm's time and CPU went: the router's and the engines'
processes, carryover's steps of a turn, and the load generator's own loop."""

from __future__ import annotations

from typing import Any

__all__ = ["cost_sections", "fmt", "percent"]


def fmt(value: Any, digits: int = 1) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def percent(share: float | None) -> str:
    return "-" if share is None else f"{share * 100:.0f}%"


def cost_sections(report: dict[str, Any]) -> list[str]:
    lines: list[str] = []
    router_cpu = report.get("router_cpu") or {}
    if router_cpu:
        lines += ["", "## Each arm's router: CPU over the run (its process tree, from /proc)", ""]
        lines += ["| arm | CPU seconds | per turn (ms) | share of one core | CPUs it ran on |"]
        lines.append("|---|---|---|---|---|")
        for arm, cpu in router_cpu.items():
            lines.append(
                f"| {arm} | {fmt(cpu['cpu_seconds'])} | {fmt(cpu['per_turn_ms'])} "
                f"| {percent(cpu['core_share'])} | {','.join(map(str, cpu['cpus']))} |"
            )
    engine_cpu = report.get("engine_cpu") or {}
    if engine_cpu:
        roles = sorted({role for used in engine_cpu.values() for role in used})
        lines += ["", "## The simulated engines' CPU (their processes, from /proc)", ""]
        lines += ["| arm | " + " | ".join(f"{role}: ms a turn, share of a core" for role in roles)]
        lines[-1] += " |"
        lines.append("|---|" + "---|" * len(roles))
        for arm, used in engine_cpu.items():
            cells = [
                f"{fmt(used[role]['per_turn_ms'])}, {percent(used[role]['core_share'])}"
                if role in used
                else "-"
                for role in roles
            ]
            lines.append(f"| {arm} | " + " | ".join(cells) + " |")
    legs = report.get("router_legs") or {}
    if legs:
        steps = sorted({step for arm_legs in legs.values() for step in arm_legs})
        lines += ["", "## carryover's turns, step by step (mean ms, its carryover_leg_seconds)", ""]
        lines += ["| arm | " + " | ".join(steps) + " |", "|---|" + "---|" * len(steps)]
        for arm, arm_legs in legs.items():
            cells = [fmt(arm_legs.get(step)) for step in steps]
            lines.append(f"| {arm} | " + " | ".join(cells) + " |")
    retried = report.get("router_retries") or {}
    causes = sorted({cause for counts in retried.values() for cause in counts})
    if causes:
        lines += ["", "## carryover's retries, by cause (its carryover_retries_total)", ""]
        lines += ["| arm | " + " | ".join(causes) + " |", "|---|" + "---|" * len(causes)]
        for arm, counts in retried.items():
            lines.append(
                f"| {arm} | " + " | ".join(fmt(counts.get(c, 0.0), 0) for c in causes) + " |"
            )
    lag = report.get("client_lag") or {}
    if lag:
        lines += ["", "## The load generator's own event loop: how late its 20 ms timer ran", ""]
        lines += [
            "| arm | mean (ms) | p50 | p99 | max | its collector: ms in all, longest pass, "
            "full passes |",
            "|---|---|---|---|---|---|",
        ]
        for arm, late in lag.items():
            collected = (
                f"{late['gc_ms']:.0f}, {late['gc_max_ms']:.1f}, {late['full_passes']:.0f}"
                if "gc_ms" in late
                else "-"
            )
            lines.append(
                f"| {arm} | {late['mean_ms']:.1f} | {late['p50_ms']:.1f} "
                f"| {late['p99_ms']:.1f} | {late['max_ms']:.1f} | {collected} |"
            )
    return lines
