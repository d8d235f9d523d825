"""KV-cache events as vLLM publishes them: a PUB socket and a ROUTER socket for replays.

Same frames, sequence numbers and replay protocol as vLLM's ``ZmqEventPublisher``
(vllm/distributed/kv_events.py): ``(topic, seq, payload)`` on PUB; a replay request
``(b"", start_seq)`` is answered with every buffered ``(b"", topic, seq, payload)`` from
``start_seq`` on and an end marker with sequence -1. ``drop_next`` leaves batches out of the
PUB stream only (a subscriber then sees a gap the replay can fill).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque

import msgspec
import zmq
import zmq.asyncio

from carryover.bench.sim.kv_wire import END_SEQ, SimEvent, encode_batch

__all__ = ["KVEventsSettings", "KvEventPublisher"]


class KVEventsSettings(msgspec.Struct, frozen=True):
    """``--kv-events-config`` keys the simulator honours (vLLM's names and defaults)."""

    enable_kv_cache_events: bool = False
    publisher: str | None = None
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    topic: str = ""


class KvEventPublisher:
    def __init__(self, settings: KVEventsSettings) -> None:
        self.settings = settings
        self._context = zmq.asyncio.Context()
        self._pub, self._replay = self._bind()
        self._topic = settings.topic.encode()
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=settings.buffer_steps)
        self._next_seq = 0
        self.drop_next = 0
        self._replays: asyncio.Task[None] | None = None
        self._rebinding: asyncio.Task[None] | None = None

    def _bind(self) -> tuple[zmq.asyncio.Socket, zmq.asyncio.Socket | None]:
        pub = self._context.socket(zmq.PUB)
        pub.setsockopt(zmq.LINGER, 0)
        pub.bind(self.settings.endpoint)
        replay = None
        if self.settings.replay_endpoint is not None:
            replay = self._context.socket(zmq.ROUTER)
            replay.setsockopt(zmq.LINGER, 0)
            replay.bind(self.settings.replay_endpoint)
        return pub, replay

    @property
    def last_seq(self) -> int:
        """The sequence number of the last batch published (-1: none yet)."""
        return self._next_seq - 1

    def start(self) -> None:
        if self._replay is not None:
            self._replays = asyncio.create_task(self._serve_replays(self._replay))

    async def publish(self, events: list[SimEvent]) -> None:
        if not events:
            return
        if self._rebinding is not None:
            await self._rebinding
            self._rebinding = None
        seq = self._next_seq
        self._next_seq += 1
        payload = encode_batch(time.time(), events, 0)
        self._buffer.append((seq, payload))
        if self.drop_next > 0:
            self.drop_next -= 1
            return
        await self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))

    def restart(self) -> None:
        """A new engine process: new sockets on the same endpoints (subscribers see their
        connection drop and come back), a sequence from 0, nothing buffered."""
        if self._replays is not None:
            self._replays.cancel()
        self._pub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)
        self._next_seq = 0
        self._buffer.clear()
        self._rebinding = asyncio.create_task(self._rebind())

    async def _rebind(self) -> None:
        # ZMQ closes sockets in its I/O thread: the port frees a moment later.
        deadline = time.monotonic() + 30
        while True:
            try:
                self._pub, self._replay = self._bind()
                break
            except zmq.ZMQError as exc:
                if exc.errno != zmq.EADDRINUSE or time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.05)
        self.start()

    async def _serve_replays(self, sock: zmq.asyncio.Socket) -> None:
        while True:
            frames = await sock.recv_multipart()
            if len(frames) != 3:
                continue
            client, _, start_bytes = frames
            start = int.from_bytes(start_bytes, "big")
            for seq, payload in list(self._buffer):
                if seq >= start:
                    await sock.send_multipart(
                        (client, b"", self._topic, seq.to_bytes(8, "big"), payload)
                    )
            await sock.send_multipart(
                (client, b"", b"", END_SEQ.to_bytes(8, "big", signed=True), b"")
            )

    async def stop(self) -> None:
        if self._rebinding is not None:
            with contextlib.suppress(Exception):
                await self._rebinding
        if self._replays is not None:
            self._replays.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._replays
        self._context.destroy(linger=0)
