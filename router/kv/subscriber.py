"""One engine's KV events into the index: a ZMQ subscription, and replays after gaps.

vLLM numbers its batches from 0 per publisher (a restart starts again at 0) and keeps the last
``buffer_steps`` of them for replay on a ROUTER socket (docs/kv-events.md). This task:

- on start, asks for a replay from 0 (what the engine did before we listened);
- applies batches in sequence order; on a gap, asks for a replay of the missing ones;
- drops the instance's entries when the sequence starts again (a restart) or a gap cannot be
  replayed (a removal may be lost, and a lost removal would never leave the index).

Routing only *chooses* instances with what it learns here; nothing it holds is trusted for
correctness, so an index that lags or is cleared costs speed, never a wrong answer.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum

import msgspec
import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from carryover.router.kv.events import (
    END_SEQ,
    AllBlocksCleared,
    KVEvent,
    KVEventBatch,
    decode_batch,
)
from carryover.router.kv.index import InstanceBlocks, Skipped
from carryover.router.kv.metrics import KvMetrics
from carryover.router.kv.warm import WarmTier

__all__ = ["EventSubscriber", "ReplayOutcome", "ResetCause"]

log = logging.getLogger("carryover.kv")


class ReplayOutcome(StrEnum):
    RECOVERED = "recovered"
    #: No replay socket configured, or it did not answer in time, or it no longer held the
    #: batches asked for.
    FAILED = "failed"


class ResetCause(StrEnum):
    RESTART = "restart"
    LOST_EVENTS = "lost_events"
    OVERFLOW = "overflow"


#: Batches read at most per wake: an engine that never stops publishing still lets the loop
#: (and the instance's monitor) have a turn.
_READ_AT_ONCE = 256

#: Seconds between reads of the socket: a decoder publishes a batch for every step that
#: fills a block (hundreds a second), and waking once per batch costs more than applying it.
#: Routing by an index 50 ms behind the engines chooses as well as by one that is current;
#: events already arrive later than that under load.
GATHER_SECONDS = 0.05


def _read_waiting(socket: zmq.Socket[bytes]) -> list[list[bytes]]:
    """The messages waiting on ``socket``, without blocking."""
    messages: list[list[bytes]] = []
    # Asking first is cheaper than the ``zmq.Again`` an empty socket raises, on every wake.
    while len(messages) < _READ_AT_ONCE and int(socket.getsockopt(zmq.EVENTS)) & zmq.POLLIN:
        try:
            messages.append(socket.recv_multipart(zmq.NOBLOCK))
        except zmq.Again:
            break
    return messages


@dataclass(slots=True)
class _Seen:
    """One index's state when a read began applying batches to it, and the events since."""

    blocks: InstanceBlocks
    overflows: int
    skipped: dict[Skipped, int]
    events: int = 0


@dataclass(slots=True)
class _Tally:
    """What the batches applied since the metrics were last set did."""

    seen: dict[str, _Seen] = field(default_factory=dict)
    newest: float | None = None  # the engine's time of the last batch applied


class EventSubscriber:
    """Keeps ``blocks`` true to the events of the engine at ``endpoint``."""

    def __init__(
        self,
        instance: str,
        endpoint: str,
        replay_endpoint: str | None,
        blocks: InstanceBlocks,
        metrics: KvMetrics,
        *,
        context: zmq.asyncio.Context,
        replay_timeout: float = 5.0,
        clock: Callable[[], float] = time.time,
        warm: WarmTier | None = None,
        gather: float = GATHER_SECONDS,
    ) -> None:
        self.instance = instance
        #: The model's warm tier: events under its medium are its blocks, not this engine's.
        #: A restart or a gap of this engine drops only the engine's own entries (the tier
        #: outlives engines).
        self.warm = warm
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.blocks = blocks
        self.metrics = metrics
        self.context = context
        self.replay_timeout = replay_timeout
        self.clock = clock
        self.gather = gather
        #: The last sequence number applied (``None``: nothing yet).
        self.last: int | None = None
        #: Batches a replay gave that may still arrive live: a live batch with the same number
        #: and bytes is a copy; other bytes under a replayed number mean a new engine.
        self._replayed: dict[int, bytes] = {}
        self._tally = _Tally()

    async def run(self) -> None:
        sub = self.context.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.setsockopt(zmq.LINGER, 0)
        # A dropped and renewed connection may be a new engine process at the same address:
        # what it held is unknown, so it counts as a restart (a replay brings back the rest).
        monitor = sub.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
        sub.connect(self.endpoint)
        # Both sockets are read by plain non-blocking calls every ``gather`` seconds, never
        # polled: the asyncio poller's futures and reader callbacks cost more per wake than a
        # decode step's batch does to apply (a busy decoder sends hundreds a second), and
        # waiting on it only while an engine is quiet cost more under load, not less
        # (``bench/RESULTS.md``). A quiet engine costs a wake every ``gather`` seconds.
        waiting: zmq.Socket[bytes] = zmq.Socket.shadow(sub)
        changes: zmq.Socket[bytes] = zmq.Socket.shadow(monitor)
        connected_before = False
        try:
            if self.replay_endpoint is not None:
                await self._replay_from(0)
            while True:
                for message in _read_waiting(changes):
                    event = parse_monitor_message(message)
                    if event["event"] == zmq.EVENT_CONNECTED:
                        if connected_before:
                            self.restarted()
                        connected_before = True
                batches = _read_waiting(waiting)
                for frames in batches:
                    if len(frames) != 3:
                        continue
                    _, seq_bytes, payload = frames
                    await self._receive(int.from_bytes(seq_bytes, "big", signed=True), payload)
                self._settle()
                # More may be waiting when the read stopped at its limit: read again at once.
                await asyncio.sleep(self.gather if len(batches) < _READ_AT_ONCE else 0)
        finally:
            sub.disable_monitor()
            monitor.close(linger=0)
            sub.close(linger=0)

    def restarted(self) -> None:
        """The instance restarted (the pool saw a new process): what it held is gone. The next
        batch (of the new engine) asks for a replay from its start."""
        self._reset(ResetCause.RESTART)
        self.last = None
        self._replayed.clear()

    async def _receive(self, seq: int, payload: bytes) -> None:
        if self._replayed:
            copy = self._replayed.get(seq)
            if copy == payload:
                return  # arrived live after a replay gave it
            if copy is None and seq > max(self._replayed):
                self._replayed.clear()  # live again past the replay
        if self.last is not None and seq <= self.last:
            # The sequence started again: a new engine process with a new cache.
            self._reset(ResetCause.RESTART)
            self.last = None
            self._replayed.clear()
        expected = 0 if self.last is None else self.last + 1
        # Joined mid-stream without a replay socket: learn from here on.
        if seq > expected and (self.last is not None or self.replay_endpoint is not None):
            await self._replay_from(expected, upto=seq)
        self._apply(seq, payload)

    async def _replay_from(self, start: int, upto: int | None = None) -> None:
        """Apply the engine's buffered batches from ``start``. ``upto`` (exclusive) is the
        batch in hand: every one before it must come back, or what we hold is incomplete.
        Without ``upto`` (the first join) whatever is still buffered is the best there is."""
        got = await self._fetch(start) if self.replay_endpoint is not None else None
        if upto is None:
            complete = got is not None
        else:
            seen = {seq for seq, _ in got or []}
            complete = all(s in seen for s in range(start, upto))
        outcome = ReplayOutcome.RECOVERED if complete else ReplayOutcome.FAILED
        self.metrics.replays.labels(self.instance, outcome).inc()
        if not complete and upto is not None:
            self._reset(ResetCause.LOST_EVENTS)
        for seq, payload in got or []:
            if upto is not None and seq >= upto:
                break  # the caller applies the batch in hand; later ones come live
            self._apply(seq, payload)
            self._replayed[seq] = payload
        self._settle()

    async def _fetch(self, start: int) -> list[tuple[int, bytes]] | None:
        """Batches ``>= start`` from the replay socket, or ``None`` if it did not finish."""
        assert self.replay_endpoint is not None
        dealer = self.context.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(self.replay_endpoint)
        got: list[tuple[int, bytes]] = []
        try:
            await dealer.send_multipart((b"", start.to_bytes(8, "big")))
            while True:
                async with asyncio.timeout(self.replay_timeout):
                    frames = await dealer.recv_multipart()
                if len(frames) != 4:
                    continue
                _, _, seq_bytes, payload = frames
                seq = int.from_bytes(seq_bytes, "big", signed=True)
                if seq == END_SEQ:
                    return got
                got.append((seq, payload))
        except TimeoutError:
            log.warning("kv events: %s did not finish a replay", self.instance)
            return None
        finally:
            dealer.close(linger=0)

    def _apply(self, seq: int, payload: bytes) -> None:
        try:
            batch, skipped = decode_batch(payload)
        except (msgspec.DecodeError, ValueError):
            self.metrics.skipped.labels(self.instance, "undecodable").inc()
            self.last = seq
            return
        if skipped:
            self.metrics.skipped.labels(self.instance, "unknown_event").inc(skipped)
        self._apply_batch(batch)
        self.last = seq

    def _apply_batch(self, batch: KVEventBatch) -> None:
        own: list[KVEvent] = batch.events
        warm = self.warm
        if warm is not None:
            medium = warm.config.medium
            own = []
            shared: list[KVEvent] = []
            for event in batch.events:
                if not isinstance(event, AllBlocksCleared) and event.medium == medium:
                    shared.append(event)
                else:
                    own.append(event)
            if shared:
                self._apply_to(warm.name, warm.blocks, shared)
        self._apply_to(self.instance, self.blocks, own)
        self._tally.newest = batch.ts

    def _apply_to(self, name: str, blocks: InstanceBlocks, events: list[KVEvent]) -> None:
        seen = self._tally.seen.get(name)
        if seen is None:
            seen = self._tally.seen[name] = _Seen(blocks, blocks.overflows, dict(blocks.skipped))
        for event in events:
            blocks.apply(event)
        seen.events += len(events)

    def _settle(self) -> None:
        """What the batches applied since the last call did, into the metrics: once a read
        of the socket, not once a batch (a decoder sends hundreds a second)."""
        tally, self._tally = self._tally, _Tally()
        for name, seen in tally.seen.items():
            blocks = seen.blocks
            if blocks.overflows != seen.overflows:
                self.metrics.resets.labels(name, ResetCause.OVERFLOW).inc(
                    blocks.overflows - seen.overflows
                )
            for why, count in blocks.skipped.items():
                if count != seen.skipped.get(why, 0):
                    self.metrics.skipped.labels(name, why).inc(count - seen.skipped.get(why, 0))
            self.metrics.events.labels(name).inc(seen.events)
            self.metrics.blocks.labels(name).set(len(blocks))
        if tally.newest is not None:
            self.metrics.lag.labels(self.instance).set(max(0.0, self.clock() - tally.newest))

    def _reset(self, cause: ResetCause) -> None:
        log.info("kv events: dropping what is known of %s (%s)", self.instance, cause)
        self.blocks.clear()
        self.metrics.resets.labels(self.instance, cause).inc()
        self.metrics.blocks.labels(self.instance).set(0)
