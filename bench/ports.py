"""Free loopback ports for the processes the benchmark and the tests start.

A port the kernel hands out for ``bind(("", 0))`` comes from the ephemeral range, and is free
again the moment the probing socket closes: before the process it was meant for binds it,
another program's ``bind(0)`` (vLLM picks its internal ports that way) or the local end of any
outgoing connection can take it. Ports are therefore drawn below the ephemeral range, where
the kernel never allocates on its own, and never handed out twice by one process. Processes
that draw side by side (the workers of a parallel test run) each draw from a share of their
own, named by ``CARRYOVER_PORT_SHARE=i/n``: no two of them can pick the same port between a
draw and its bind.
"""

from __future__ import annotations

import os
import random
import socket
import threading
from pathlib import Path

__all__ = ["free_port"]

_LOWEST = 10_000
_given: set[int] = set()
_lock = threading.Lock()
_rng = random.SystemRandom()  # separate processes must not draw the same sequence


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32_768


def _bindable(port: int) -> bool:
    # vLLM binds its event sockets on every interface ("tcp://*:PORT"): try both.
    for host in ("127.0.0.1", "0.0.0.0"):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind((host, port))
            except OSError:
                return False
    return True


def _share(low: int, high: int) -> tuple[int, int]:
    """This process's part of ``[low, high]`` under ``CARRYOVER_PORT_SHARE`` (all of it when
    unset)."""
    share = os.environ.get("CARRYOVER_PORT_SHARE")
    if not share:
        return low, high
    index, count = (int(part) for part in share.split("/"))
    width = (high - low + 1) // count
    return low + index * width, low + (index + 1) * width - 1


def free_port() -> int:
    low, high = _share(_LOWEST, _ephemeral_low() - 1)
    with _lock:
        if high - low < 1_000:  # an unusual range: fall back to the kernel's choice
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
                sock.bind(("127.0.0.1", 0))
                port: int = sock.getsockname()[1]
                return port
        for _ in range(1_000):
            port = _rng.randint(low, high)
            if port not in _given and _bindable(port):
                _given.add(port)
                return port
    raise RuntimeError(f"no free port between {low} and {high}")
