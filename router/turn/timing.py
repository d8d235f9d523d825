"""The timer and span of one step of a turn (``carryover_leg_seconds``)."""

from __future__ import annotations

import time
from contextlib import AbstractContextManager
from types import TracebackType
from typing import TYPE_CHECKING, Any

from carryover.router.metrics import RouterMetrics

if TYPE_CHECKING:
    from carryover.router.turn.model import TurnRequest

__all__ = ["timed"]


class timed:
    """Time one step of the turn: the leg histogram, and a span when tracing is on. A class,
    not a generator: a turn times four or five steps."""

    __slots__ = ("_histogram", "_span", "_started")

    def __init__(
        self, metrics: RouterMetrics, req: TurnRequest, name: str, **attributes: Any
    ) -> None:
        self._histogram = metrics.legs.labels(name)
        self._span: AbstractContextManager[None] = req.trace.leg(name, **attributes)
        self._started = 0.0

    def __enter__(self) -> None:
        self._started = time.perf_counter()
        self._span.__enter__()

    def __exit__(
        self,
        kind: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool | None:
        try:
            return self._span.__exit__(kind, exc, tb)
        finally:
            self._histogram.observe(time.perf_counter() - self._started)
