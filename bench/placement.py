"""Where a benchmark's processes run on this host. On a fleet the router has CPUs of its own
and the engines are GPUs on hosts of their own; on a small machine everything shares its
cores. Two settings bring a run closer to the fleet: the simulated engines at a lower
priority, and the routers under test on CPUs that nothing else of the run uses (the
simulated engines, their helpers and the load generator run on the others)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

__all__ = ["Placement", "parse_cpus"]


def parse_cpus(text: str, available: frozenset[int] | None = None) -> frozenset[int]:
    """``taskset``'s list syntax (``1``, ``0-1``, ``2,4-5``), checked against the CPUs this
    process may use: the routers' CPUs must leave at least one for the rest of the run."""
    usable = frozenset(os.sched_getaffinity(0)) if available is None else available
    cpus: set[int] = set()
    try:
        for part in text.split(","):
            low, _, high = part.strip().partition("-")
            cpus.update(range(int(low), int(high or low) + 1))
    except ValueError:
        raise ValueError(f"not a CPU list: {text!r} (e.g. 1 or 2-3)") from None
    if not cpus or not cpus <= usable:
        raise ValueError(f"CPUs {text!r} are not all usable here (usable: {_listed(usable)})")
    if cpus == usable:
        raise ValueError(f"CPUs {text!r} leave none for the engines and the load generator")
    return frozenset(cpus)


def _listed(cpus: frozenset[int]) -> str:
    return ",".join(str(c) for c in sorted(cpus))


@dataclass(frozen=True)
class Placement:
    #: Niceness of the simulated engines and their helpers (0: as the routers).
    engine_nice: int = 0
    #: CPUs of the routers under test; empty: every process may run on every CPU.
    router_cpus: frozenset[int] = frozenset()

    @property
    def rest_cpus(self) -> frozenset[int]:
        """The CPUs of every other process of the run (empty: unrestricted)."""
        if not self.router_cpus:
            return frozenset()
        return frozenset(os.sched_getaffinity(0)) - self.router_cpus

    def router_command(self, command: Sequence[str]) -> tuple[str, ...]:
        return _on(self.router_cpus, tuple(command))

    def engine_command(self, command: Sequence[str]) -> tuple[str, ...]:
        niced = ("nice", "-n", str(self.engine_nice), *command) if self.engine_nice else command
        return _on(self.rest_cpus, tuple(niced))

    @contextlib.contextmanager
    def load_generator(self) -> Iterator[None]:
        """This process (the load generator, and the threads and children it starts meanwhile)
        on the rest's CPUs, restored after."""
        rest = self.rest_cpus
        if not rest:
            yield
            return
        before = os.sched_getaffinity(0)
        os.sched_setaffinity(0, rest)
        try:
            yield
        finally:
            os.sched_setaffinity(0, before)

    def describe(self) -> str:
        nice = f"engines at niceness {self.engine_nice}"
        if not self.router_cpus:
            return f"{nice}; every process on every CPU"
        return (
            f"{nice}; routers on CPU {_listed(self.router_cpus)}, engines and load generator "
            f"on CPU {_listed(self.rest_cpus)}"
        )


def _on(cpus: frozenset[int], command: tuple[str, ...]) -> tuple[str, ...]:
    return ("taskset", "-c", _listed(cpus), *command) if cpus else command
