"""The test client's resend of a GET whose pooled connection the server closed unanswered."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
from collections.abc import AsyncIterator

import httpx
import pytest

from tests.support.http import SAFE_TO_RESEND, ResendStaleGets
from tests.support.ports import free_port

OK = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: keep-alive\r\n\r\nok"


async def _read_request(reader: asyncio.StreamReader) -> bool:
    length = 0
    while (line := await reader.readline()) not in (b"\r\n", b""):
        if line.lower().startswith(b"content-length:"):
            length = int(line.split(b":")[1])
    if not line:
        return False
    await reader.readexactly(length)
    return True


@contextlib.asynccontextmanager
async def closing_on_second_request(reset: bool = False) -> AsyncIterator[str]:
    """Answers every connection's first request and closes it, unanswered, on the second:
    what a server whose idle close crossed the client's reuse looks like from the client.
    With ``reset`` the close is an RST (the client reads ECONNRESET), not a FIN."""
    port = free_port()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(ConnectionError):
            if await _read_request(reader):
                writer.write(OK)
                await writer.drain()
                await _read_request(reader)
        if reset:
            linger_zero = struct.pack("ii", 1, 0)
            writer.get_extra_info("socket").setsockopt(
                socket.SOL_SOCKET, socket.SO_LINGER, linger_zero
            )
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", port)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.close()
        await server.wait_closed()


@pytest.mark.parametrize("reset", [False, True], ids=["closed", "reset"])
async def test_a_get_on_a_connection_closed_unanswered_is_sent_again(reset: bool) -> None:
    resending = httpx.AsyncClient(transport=ResendStaleGets())
    async with closing_on_second_request(reset) as url, resending as client:
        assert (await client.get(url)).text == "ok"
        assert (await client.get(url)).text == "ok"  # the pooled one failed, a new one answered


@pytest.mark.parametrize("reset", [False, True], ids=["closed", "reset"])
async def test_without_the_resend_the_same_get_fails(reset: bool) -> None:
    async with closing_on_second_request(reset) as url, httpx.AsyncClient() as client:
        await client.get(url)
        with pytest.raises((httpx.RemoteProtocolError, httpx.ReadError)):
            await client.get(url)


async def test_a_post_is_not_sent_again() -> None:
    resending = httpx.AsyncClient(transport=ResendStaleGets())
    async with closing_on_second_request() as url, resending as client:
        await client.post(url, content=b"{}")
        with pytest.raises(httpx.RemoteProtocolError):
            await client.post(url, content=b"{}")


@pytest.mark.parametrize("reset", [False, True], ids=["closed", "reset"])
async def test_a_post_marked_safe_to_resend_is_sent_again(reset: bool) -> None:
    resending = httpx.AsyncClient(transport=ResendStaleGets())
    async with closing_on_second_request(reset) as url, resending as client:
        await client.post(url, content=b"{}")
        assert (await client.post(url, content=b"{}", extensions=SAFE_TO_RESEND)).text == "ok"
