"""Free loopback ports for test servers (outside the kernel's ephemeral range)."""

from __future__ import annotations

from carryover.bench.ports import free_port

__all__ = ["free_port"]
