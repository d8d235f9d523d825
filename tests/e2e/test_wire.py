"""The production wire (router/engines/h1.py) against real sockets on loopback that misbehave on
purpose: every failure maps to the error the turn logic retries, or does not retry, by
(router/engines/wire.py), and a connection goes back to the pool only after a whole, keep-alive
exchange."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest

from carryover.router.config import Timeouts
from carryover.router.engines.h1 import H1Wire
from carryover.router.engines.upstream import Upstream
from carryover.router.errors import EngineFailed, EngineTimeout, EngineUnavailable
from tests.support.ports import free_port
from tests.support.waiting import eventually


async def _request_head(reader: asyncio.StreamReader) -> int:
    """Read a request's head and body; its Content-Length."""
    length = 0
    while (line := await reader.readline()) not in (b"\r\n", b""):
        if line.lower().startswith(b"content-length:"):
            length = int(line.split(b":")[1])
    await reader.readexactly(length)
    return length


Serve = Callable[[asyncio.StreamReader, asyncio.StreamWriter, asyncio.Event], Awaitable[None]]


@contextlib.asynccontextmanager
async def serving(serve: Serve) -> AsyncIterator[str]:
    port = free_port()
    done = asyncio.Event()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await serve(reader, writer, done)
        finally:
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()

    server = await asyncio.start_server(handle, "127.0.0.1", port)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        done.set()
        server.close()
        await server.wait_closed()


@pytest.fixture
async def upstream() -> AsyncIterator[Upstream]:
    client = Upstream(Timeouts(connect=1.0, request=5.0))
    yield client
    await client.aclose()


async def test_a_refused_connection_is_unavailable(upstream: Upstream) -> None:
    with pytest.raises(EngineUnavailable):
        await upstream.post_json(f"http://127.0.0.1:{free_port()}/v1/x", {}, timeout=2)


async def test_an_engine_that_never_answers_timed_out_and_was_sent_the_request(
    upstream: Upstream,
) -> None:
    got = asyncio.Event()

    async def silent(
        reader: asyncio.StreamReader, writer: asyncio.StreamWriter, done: asyncio.Event
    ) -> None:
        await _request_head(reader)
        got.set()
        await done.wait()  # holds the connection open, answers nothing

    async with serving(silent) as url:
        with pytest.raises(EngineTimeout):
            await upstream.post_json(url + "/v1/x", {"a": 1}, timeout=0.3)
        assert got.is_set()


def _half_answer(*, then_close: bool) -> Serve:
    """A head and the start of a 100-byte body, then a close or silence."""

    async def serve(
        reader: asyncio.StreamReader, writer: asyncio.StreamWriter, done: asyncio.Event
    ) -> None:
        await _request_head(reader)
        writer.write(b'HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n{"a":')
        await writer.drain()
        if then_close:
            writer.close()
        else:
            await done.wait()

    return serve


async def test_a_body_that_stalls_after_its_head_is_a_timeout(upstream: Upstream) -> None:
    """The timeout given with the send also bounds the body's read."""
    async with serving(_half_answer(then_close=False)) as url:
        with pytest.raises(EngineTimeout, match=r"did not finish within 0\.5 s"):
            await upstream.post_json(url + "/v1/x", {}, timeout=0.5)


async def test_a_body_cut_short_broke_off_and_an_error_status_keeps_its_message(
    upstream: Upstream,
) -> None:
    async with serving(_half_answer(then_close=True)) as url:
        with pytest.raises(EngineFailed) as failed:
            await upstream.post_json(url + "/v1/x", {}, timeout=2)
        assert failed.value.upstream_status is None

    async def refuses(
        reader: asyncio.StreamReader, writer: asyncio.StreamWriter, done: asyncio.Event
    ) -> None:
        await _request_head(reader)
        body = b'{"error": {"message": "expired handle", "code": 500}}'
        writer.write(
            b"HTTP/1.1 500 Internal Server Error\r\nContent-Length: %d\r\n\r\n" % len(body)
        )
        writer.write(body)
        await writer.drain()

    async with serving(refuses) as url:
        with pytest.raises(EngineFailed) as failed:
            await upstream.post_json(url + "/v1/x", {}, timeout=2)
        assert (failed.value.upstream_status, failed.value.message) == (500, "expired handle")


async def test_a_stream_yields_its_events_and_a_stall_is_a_timeout(upstream: Upstream) -> None:
    async def sse(
        reader: asyncio.StreamReader, writer: asyncio.StreamWriter, done: asyncio.Event
    ) -> None:
        await _request_head(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n\r\n")
        writer.write(b'data: {"n": 1}\r\n\r\n: a comment\n\ndata: {"n": 2}\n\n')
        await writer.drain()
        await done.wait()  # then nothing more

    async with serving(sse) as url:
        events = []
        async with upstream.stream(url + "/v1/x", {}, first_byte=2) as response:
            with pytest.raises(EngineTimeout):
                async for data in response.events(0.3):
                    events.append(data)
        assert events == [b'{"n": 1}', b'{"n": 2}']


async def test_a_stream_line_of_megabytes_arrives_whole(upstream: Upstream) -> None:
    # A D stream's first chunk carries every prompt id: 4 MB is a 600k-token prompt (past
    # aiohttp's own line limit, which the previous wire had).
    big = b'{"prompt_token_ids": [' + b",".join(b"151643" for _ in range(600_000)) + b"]}"

    async def sse(
        reader: asyncio.StreamReader, writer: asyncio.StreamWriter, done: asyncio.Event
    ) -> None:
        await _request_head(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n\r\n")
        writer.write(b"data: " + big + b"\n\ndata: [DONE]\n\n")
        await writer.drain()

    async with serving(sse) as url, upstream.stream(url + "/v1/x", {}, first_byte=2) as response:
        events = [data async for data in response.events(2)]
    assert events == [big, b"[DONE]"]


def _answer(body: bytes, *extra: bytes) -> bytes:
    head = b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n" % len(body)
    return head + b"".join(extra) + b"\r\n" + body


async def test_a_connection_is_reused_after_a_whole_exchange_and_only_then() -> None:
    connections: list[int] = []

    async def keeps(
        reader: asyncio.StreamReader, writer: asyncio.StreamWriter, done: asyncio.Event
    ) -> None:
        connections.append(len(connections))
        exchange = 0
        while not reader.at_eof():
            try:
                await _request_head(reader)
            except (asyncio.IncompleteReadError, ConnectionError):
                return
            exchange += 1
            if exchange == 1:
                writer.write(_answer(b'{"n": 1}'))
            elif exchange == 2:  # chunked, in three pieces
                writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
                for piece in (b'{"n"', b": ", b"2}"):
                    writer.write(b"%x\r\n%s\r\n" % (len(piece), piece))
                writer.write(b"0\r\n\r\n")
            else:  # says it closes: the next request needs a new connection
                writer.write(_answer(b'{"n": 3}', b"Connection: close\r\n"))
                await writer.drain()
                return
            await writer.drain()

    upstream = Upstream(Timeouts(connect=1.0, request=5.0))
    try:
        async with serving(keeps) as url:
            answers = [await upstream.post_json(url + "/v1/x", {}, timeout=2) for _ in range(4)]
    finally:
        await upstream.aclose()
    assert answers == [{"n": 1}, {"n": 2}, {"n": 3}, {"n": 1}]
    assert connections == [0, 1]


async def test_a_malformed_answer_broke_off_and_a_cancelled_read_is_not_pooled() -> None:
    connections: list[int] = []

    async def garbles(
        reader: asyncio.StreamReader, writer: asyncio.StreamWriter, done: asyncio.Event
    ) -> None:
        connections.append(len(connections))
        await _request_head(reader)
        if len(connections) == 1:
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: x\r\n\r\n{}")
        elif len(connections) == 2:
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\n{")  # stalls
        else:
            writer.write(_answer(b"{}"))
        await writer.drain()
        await done.wait()

    upstream = Upstream(Timeouts(connect=1.0, request=5.0))
    try:
        async with serving(garbles) as url:
            with pytest.raises(EngineFailed, match="malformed"):
                await upstream.post_json(url + "/v1/x", {}, timeout=2)
            with pytest.raises(EngineTimeout, match="did not finish"):
                await upstream.post_json(url + "/v1/x", {}, timeout=0.3)
            assert await upstream.post_json(url + "/v1/x", {}, timeout=2) == {}
    finally:
        await upstream.aclose()
    assert connections == [0, 1, 2]  # neither broken exchange left its connection in the pool


async def test_a_stream_past_the_read_pause_arrives_in_order(upstream: Upstream) -> None:
    # 12 MB of events. The reader takes the first line, then waits until the wire has stopped
    # reading the socket (over 4 MiB unread) before taking the rest: every line must still
    # arrive, in order, as reading resumes.
    lines = [b"data: " + b"%06d" % n + b"x" * 4000 for n in range(3000)]

    async def sse(
        reader: asyncio.StreamReader, writer: asyncio.StreamWriter, done: asyncio.Event
    ) -> None:
        await _request_head(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        for line in lines:
            piece = line + b"\n\n"
            writer.write(b"%x\r\n%s\r\n" % (len(piece), piece))
            await writer.drain()
        writer.write(b"0\r\n\r\n")
        await writer.drain()
        await done.wait()

    async def paused() -> bool:
        return bool(response._connection.paused)  # type: ignore[attr-defined]

    async with serving(sse) as url, upstream.stream(url + "/v1/x", {}, first_byte=2) as response:
        got = []
        async for data in response.events(5):
            got.append(data[:6])
            if len(got) == 1:
                await eventually(paused, what="the wire stops reading", interval=0.01)
    assert got == [b"%06d" % n for n in range(3000)]


async def test_idle_connections_past_the_keepalive_are_closed_not_reused() -> None:
    now = [0.0]
    connections: list[asyncio.StreamReader] = []
    ended: list[int] = []  # the connections the client closed, by when they opened
    changed = asyncio.Event()

    async def keeps(
        reader: asyncio.StreamReader, writer: asyncio.StreamWriter, done: asyncio.Event
    ) -> None:
        index = len(connections)
        connections.append(reader)
        while True:
            try:
                await _request_head(reader)
            except (asyncio.IncompleteReadError, ConnectionError):
                break
            if reader.at_eof():
                break
            writer.write(_answer(b"{}"))
            await writer.drain()
        ended.append(index)
        changed.set()

    async def ended_are(expected: list[int]) -> None:
        while sorted(ended) != expected:
            changed.clear()
            await asyncio.wait_for(changed.wait(), 5)

    wire = H1Wire(connect_timeout=1.0, keepalive=4.0, clock=lambda: now[0])
    try:
        async with serving(keeps) as url:

            async def one() -> None:
                response = await wire.send("POST", url + "/v1/x", b"{}", {}, "x")
                assert await response.read() == b"{}"

            await asyncio.gather(one(), one(), one())  # a burst at 0 s: three connections
            assert (len(connections), wire.idle_connections()) == (3, 3)
            now[0] = 3.0
            await one()  # light traffic: the newest, again and again
            now[0] = 6.0
            await one()
            # The two the burst left behind are 6 s idle: closed, though nothing reached them.
            assert (len(connections), wire.idle_connections()) == (3, 1)
            await ended_are([0, 1])
            now[0] = 11.0  # the last one too: a new connection serves
            await one()
            assert (len(connections), wire.idle_connections()) == (4, 1)
            await ended_are([0, 1, 2])
    finally:
        await wire.aclose()
