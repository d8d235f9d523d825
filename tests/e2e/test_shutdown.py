"""Graceful shutdown: streams in flight finish and their records are committed."""

from __future__ import annotations

import asyncio
import signal
import uuid
from pathlib import Path
from typing import Any

from carryover.bench.redis_server import RedisServer
from tests.support.metrics import ascrape
from tests.support.stack import chat_turn, stack
from tests.support.waiting import eventually

TEXT = (
    "Tell me slowly about rivers and stones in an old garden, and the gardener, season by season. "
)


async def test_sigterm_lets_streams_finish_and_commit(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    flags = ("--redis", redis_server.url)
    # Real-time decode steps (7 ms each): a 150-token answer streams for about a second.
    async with stack(
        tmp_path, routers=2, router_flags=flags, sim={"threshold": 16, "speed": 1.0}
    ) as s:
        conversation = uuid.uuid4().hex
        messages: list[dict[str, Any]] = [{"role": "user", "content": TEXT * 2}]
        victim = s.routers[0]
        stream = asyncio.create_task(
            chat_turn(
                s.client,
                victim.url,
                messages,
                stream=True,
                conversation_id=conversation,
                max_tokens=150,
                ignore_eos=True,
            )
        )
        # The stream is under way once D generates it (SIGTERM after it ended would prove
        # nothing more than a plain stop; before it, the router must still finish the turn).
        await eventually(
            lambda: ascrape(s.client, s.decode[0].url),
            lambda m: m.get("vllm:num_requests_running", 0) >= 1,
            what="D decodes the stream",
            interval=0.01,
        )
        assert victim.process is not None
        victim.process.send_signal(signal.SIGTERM)
        # D still runs the turn after the signal: it was in flight when the router got it
        # (a stream already over would make this test a plain stop).
        running = await ascrape(s.client, s.decode[0].url)
        assert running["vllm:num_requests_running"] >= 1 and not stream.done()
        got = await stream
        assert got.status == 200 and got.chunks[-1] == "[DONE]"
        assert not any(isinstance(c, dict) and "error" in c for c in got.chunks)
        await asyncio.to_thread(victim.process.wait, 30)
        # Its record was committed before it went: the other router reuses it.
        messages += [
            {"role": "assistant", "content": got.content},
            {"role": "user", "content": TEXT},
        ]
        nxt = await chat_turn(s.client, s.routers[1].url, messages, conversation_id=conversation)
        assert nxt.path == "reuse"
