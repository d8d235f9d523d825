"""CPU and memory of a process and its descendants, read from /proc (Linux)."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["CpuMeter", "cpu_seconds", "engines_cpu", "listening_pid", "rss_mb", "tree"]

_TICKS = os.sysconf("SC_CLK_TCK")


def tree(pid: int) -> list[int]:
    """The process and every descendant (a router's workers, say). Raises
    ``ProcessLookupError`` when ``pid`` itself is gone; a descendant that ends while the tree
    is walked is left out."""
    if not Path(f"/proc/{pid}").exists():
        raise ProcessLookupError(pid)
    pids = [pid]
    for child in _children(pid):
        try:
            pids += tree(child)
        except ProcessLookupError:
            continue
    return pids


def _children(pid: int) -> list[int]:
    children: list[int] = []
    try:
        for task in Path(f"/proc/{pid}/task").iterdir():
            children += [int(c) for c in (task / "children").read_text().split()]
    except FileNotFoundError:
        pass  # ended after it was listed: whatever it had is gone with it
    return children


def cpu_seconds(pid: int) -> float:
    """User and system CPU of the process tree so far."""
    total = 0
    for p in tree(pid):
        stat = _read(p, "stat")
        if stat is None:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        total += int(fields[11]) + int(fields[12])  # utime + stime
    return total / _TICKS


class CpuMeter:
    """The CPU a process tree uses from now on (workers it starts later included)."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.start = cpu_seconds(pid)

    def seconds(self) -> float:
        """CPU seconds since the start."""
        return cpu_seconds(self.pid) - self.start

    def used(self, wall: float, *, turns: int) -> dict[str, Any]:
        """CPU seconds since the start, per turn, as a share of one core over ``wall``
        seconds, and the CPUs the process may run on."""
        seconds = self.seconds()
        return {
            "cpu_seconds": seconds,
            "per_turn_ms": seconds / turns * 1000 if turns else None,
            "core_share": seconds / wall if wall > 0 else None,
            "cpus": sorted(os.sched_getaffinity(self.pid)),
        }


def engines_cpu(
    meters: Sequence[tuple[str, CpuMeter]], wall: float, *, turns: int
) -> dict[str, dict[str, float]] | None:
    """The CPU of processes metered by role (``prefill``, ``decode``), summed per role: ms a
    turn and share of one core over ``wall`` seconds. ``None`` without any."""
    seconds: dict[str, float] = {}
    for role, meter in meters:
        seconds[role] = seconds.get(role, 0.0) + meter.seconds()
    if not seconds or not turns:
        return None
    return {
        role: {"per_turn_ms": used / turns * 1000, "core_share": used / wall if wall > 0 else 0.0}
        for role, used in seconds.items()
    }


def rss_mb(pid: int, *, peak: bool = False) -> float:
    """Resident memory now (``VmRSS``) or at its peak (``VmHWM``), summed over the tree."""
    field = "VmHWM:" if peak else "VmRSS:"
    total = 0
    for p in tree(pid):
        for line in (_read(p, "status") or "").splitlines():
            if line.startswith(field):
                total += int(line.split()[1])
    return total / 1024


def _read(pid: int, name: str) -> str | None:
    """``/proc/<pid>/<name>``, or None for a process that ended after the tree was listed
    (a helper a worker started and reaped between the two reads)."""
    try:
        return Path(f"/proc/{pid}/{name}").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None


def listening_pid(port: int) -> int | None:
    """The process that listens on a loopback TCP port (an already running peer router),
    found by the socket's inode; the oldest when several share it."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:  # LISTEN
                inodes.add(fields[9])
    owners = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            for fd in (entry / "fd").iterdir():
                link = os.readlink(fd)
                if link.startswith("socket:[") and link[8:-1] in inodes:
                    owners.append(int(entry.name))
                    break
        except OSError:
            continue
    return min(owners) if owners else None
