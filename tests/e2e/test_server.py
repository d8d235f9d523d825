"""The HTTP server in front of the app (uvicorn): what a client's connection pool relies on."""

from __future__ import annotations

import select
import socket
from pathlib import Path

from tests.support.router_proc import RouterProcess

_HEALTH = b"GET /health HTTP/1.1\r\nhost: router\r\n\r\n"


def _exchange(sock: socket.socket) -> bytes:
    """One GET /health on ``sock``; the whole answer, read by its Content-Length."""
    sock.sendall(_HEALTH)
    answer = b""
    while b"\r\n\r\n" not in answer:
        answer += _received(sock, answer)
    head, body = answer.split(b"\r\n\r\n", 1)
    length = next(
        int(line.split(b":")[1])
        for line in head.split(b"\r\n")
        if line.lower().startswith(b"content-length:")
    )
    while len(body) < length:
        body += _received(sock, answer + body)
    return head


def _received(sock: socket.socket, so_far: bytes) -> bytes:
    chunk = sock.recv(65536)
    assert chunk, f"the router closed the connection: {so_far!r}"
    return chunk


async def test_an_idle_client_connection_outlives_the_clients_own_pool_expiry(
    tmp_path: Path,
) -> None:
    # httpx (and so the openai client) reuses a pooled connection idle for up to 5 s. A server
    # that closes idle connections at 5 s closes some of them just as a request goes out on
    # them: the client sees a reset or an empty answer (seen in the soak as ReadError and
    # RemoteProtocolError). The router keeps them longer, so the client closes first.
    router = RouterProcess(
        ["--prefill", "http://127.0.0.1:9", "--decode", "http://127.0.0.1:10"], tmp_path
    )
    await router.start(ready=False)
    try:
        with socket.create_connection(("127.0.0.1", router.port), timeout=10) as sock:
            assert _exchange(sock).startswith(b"HTTP/1.1 200")
            # Readable before the deadline means the router closed it (EOF).
            closed, _, _ = select.select([sock], [], [], 6.5)
            assert not closed, "the router closed an idle connection within 6.5 s"
            assert _exchange(sock).startswith(b"HTTP/1.1 200")
    finally:
        router.stop()
