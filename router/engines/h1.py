"""A lean HTTP/1.1 client for the engine hops: pooled keep-alive connections, one exchange at
a time on each, responses parsed by llhttp (``httptools``, uvicorn's parser).

A turn makes two engine calls, and a general-purpose client spends more CPU on each than the
rest of the turn does (``bench/RESULTS.md``, router overhead): aiohttp builds request, response,
header and timer objects per call. The engines speak plain HTTP/1.1 on a private network, so
this client does only what those calls need: write the request in one go, read the head, hand
the body over whole or line by line, and put the connection back when the body is done. Its
errors are the router's own (``router/errors.py``), classified where they happen.

Deadlines are the caller's (``router/engines/upstream.py`` wraps every call in one); this module only
bounds the TCP connect, so a connection that is never made is told apart from an engine that
is slow to answer.

No request is ever sent twice, not even one whose pooled connection turns out to be closed:
the engine may have run it (a P leg that pulled a handle must not pull it again). Such an
exchange is an ``EngineFailed`` like any broken one, and idle connections are dropped after
``keepalive`` seconds, before the engine's own idle close, so that race stays rare.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable, Mapping
from functools import lru_cache
from urllib.parse import urlsplit

import httptools

from carryover.router.errors import EngineFailed, EngineTimeout, EngineUnavailable

__all__ = ["H1Response", "H1Wire"]

#: The longest line ``lines()`` hands over (a D stream's first SSE chunk carries the prompt's
#: ids, about 7 bytes a token).
MAX_LINE = 64 * 1024 * 1024
#: A stream's unread bytes above which the socket stops being read (the engine then waits on
#: TCP, as it would for a slow client), and below which reading resumes.
_PAUSE_ABOVE = 4 * 1024 * 1024
_RESUME_BELOW = 1024 * 1024


@lru_cache(maxsize=1024)
def _target(url: str) -> tuple[tuple[str, int], bytes]:
    """(host, port) and the request line's target with its Host header, per URL."""
    parts = urlsplit(url)
    if parts.scheme != "http" or not parts.hostname:
        raise ValueError(f"only http:// URLs are supported: {url}")
    port = parts.port or 80
    path = parts.path or "/"
    if parts.query:
        path += "?" + parts.query
    host = parts.netloc
    return (parts.hostname, port), f"{path} HTTP/1.1\r\nHost: {host}\r\n".encode("latin-1")


class _Connection(asyncio.Protocol):
    """One TCP connection and the exchange on it; the parser's callbacks fill it in."""

    def __init__(self) -> None:
        # Looked up once per connection, not once per wait.
        self.loop = asyncio.get_running_loop()
        self.transport: asyncio.Transport | None = None
        self._parser = httptools.HttpResponseParser(self)
        self._waiter: asyncio.Future[None] | None = None
        self.closed = False
        self.idle_since = 0.0
        self.address: tuple[str, int] = ("", 0)
        self._reset()

    def _reset(self) -> None:
        self.status = 0
        self.head_done = False
        self.complete = False
        self.keep_alive = False
        self.framed = False  # a Content-Length or chunked body: its end is not the socket's
        self.chunks: list[bytes] = []
        self.buffered = 0
        self.streaming = False
        self.paused = False
        self.error: str | None = None

    # -- asyncio.Protocol --------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's is not a subclass

    def data_received(self, data: bytes) -> None:
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self.error = f"sent a malformed response ({exc})"
            self._close()
            self._wake()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self.head_done and not self.complete and not self.framed and self.error is None:
            self.complete = True  # a body that ends with the connection
        elif not self.complete and self.error is None:
            self.error = "closed the connection"
        self._wake()

    # -- httptools callbacks -----------------------------------------------------------------

    def on_header(self, name: bytes, value: bytes) -> None:
        lowered = name.lower()
        if lowered == b"content-length" or (
            lowered == b"transfer-encoding" and b"chunked" in value.lower()
        ):
            self.framed = True

    def on_headers_complete(self) -> None:
        self.status = self._parser.get_status_code()
        self.keep_alive = self._parser.should_keep_alive()
        self.head_done = True
        self._wake()

    def on_body(self, body: bytes) -> None:
        self.chunks.append(body)
        self.buffered += len(body)
        if self.streaming and not self.paused and self.buffered > _PAUSE_ABOVE:
            self.paused = True
            assert self.transport is not None
            self.transport.pause_reading()
        self._wake()

    def on_message_complete(self) -> None:
        self.complete = True
        self._wake()

    # -- the exchange ------------------------------------------------------------------------

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def wait(self, timeout: float | None = None, *, deadline: float | None = None) -> None:
        """Until the parser or the socket has news; ``TimeoutError`` after ``timeout`` s
        without any, or at ``deadline`` (the loop's time). One timer handle rather than an
        ``asyncio.timeout`` scope per exchange (a scope looks up the loop and the task and
        reschedules; bench/RESULTS.md has what dropping them saved)."""
        loop = self.loop
        waiter = self._waiter = loop.create_future()
        if deadline is not None:
            expiry: asyncio.TimerHandle | None = loop.call_at(deadline, _expire, waiter)
        elif timeout is not None:
            expiry = loop.call_later(timeout, _expire, waiter)
        else:
            expiry = None
        try:
            await waiter
        finally:
            self._waiter = None
            if expiry is not None:
                expiry.cancel()

    def take(self) -> list[bytes]:
        chunks, self.chunks, self.buffered = self.chunks, [], 0
        if self.paused and self.transport is not None:
            self.paused = False
            self.transport.resume_reading()
        return chunks

    def send(self, head: bytes, content: bytes | None) -> None:
        self._reset()
        assert self.transport is not None
        if content:
            self.transport.writelines((head, content))
        else:
            self.transport.write(head)

    def reusable(self) -> bool:
        return (
            self.complete
            and self.keep_alive
            and self.error is None
            and not self.closed
            and self.transport is not None
            and not self.transport.is_closing()
        )

    def _close(self) -> None:
        if self.transport is not None:
            self.transport.close()
        self.closed = True


def _payload(line: bytes) -> bytes:
    """A ``data:`` line's value, without the spaces after the colon or a ``\\r`` ending."""
    return line[5:].lstrip(b" ").rstrip(b"\r")


def _expire(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_exception(TimeoutError())


class H1Response:
    """The response of one exchange; its body is read whole or line by line, once."""

    __slots__ = ("_connection", "_deadline", "_pool", "_released", "_what", "status")

    def __init__(
        self, connection: _Connection, pool: H1Wire, what: str, deadline: float | None
    ) -> None:
        self._connection = connection
        self._pool = pool
        self._what = what
        self._deadline = deadline
        self._released = False
        self.status = connection.status

    def _broke(self) -> EngineFailed:
        return EngineFailed(f"{self._what} broke off: it {self._connection.error}")

    async def read(self) -> bytes:
        connection = self._connection
        try:
            while not connection.complete:
                if connection.error is not None:
                    raise self._broke()
                await connection.wait(deadline=self._deadline)
            if connection.error is not None:
                raise self._broke()
            return b"".join(connection.take())
        finally:
            await self.close()

    async def events(self, idle_timeout: float) -> AsyncIterator[bytes]:
        """The ``data:`` payloads of an SSE body; ``EngineTimeout`` once no byte came for
        ``idle_timeout`` seconds. The timer runs only while the socket is waited on: events
        already read go out without one. Lines are split and filtered here, on bytes, so an
        event crosses one generator between the socket and the relay."""
        connection = self._connection
        connection.streaming = True
        pending = b""
        while True:
            chunks = connection.take()
            if chunks:
                data = pending + b"".join(chunks) if pending else b"".join(chunks)
                *whole, pending = data.split(b"\n")
                for line in whole:
                    if line.startswith(b"data:"):
                        yield _payload(line)
                if len(pending) > MAX_LINE:
                    raise EngineFailed(f"{self._what} sent a line over {MAX_LINE} bytes")
                continue
            if connection.error is not None:
                raise self._broke()
            if connection.complete:
                if pending.startswith(b"data:"):
                    yield _payload(pending)
                return
            try:
                await connection.wait(idle_timeout)
            except TimeoutError as exc:
                raise EngineTimeout(f"{self._what} stalled for {idle_timeout:g} s") from exc

    async def close(self) -> None:
        if self._released:
            return
        self._released = True
        self._pool.release(self._connection)


class H1Wire:
    """Idle keep-alive connections per (host, port), newest first; one closed after
    ``keepalive`` idle seconds (below vLLM's own 5 s, so the engine never closes one under a
    request being sent)."""

    def __init__(
        self,
        *,
        connect_timeout: float,
        keepalive: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._connect_timeout = connect_timeout
        self._keepalive = keepalive
        self._clock = clock
        self._idle: dict[tuple[str, int], list[_Connection]] = {}
        self._closed = False

    async def _checkout(self, address: tuple[str, int], what: str) -> _Connection:
        idle = self._idle.get(address)
        now = self._clock()
        while idle:
            connection = idle.pop()
            if self._stale(connection, now):
                connection._close()
                continue
            return connection
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self._connect_timeout):
                _, protocol = await loop.create_connection(_Connection, *address)
        except TimeoutError as exc:
            raise EngineUnavailable(f"cannot connect to {what} in time") from exc
        except OSError as exc:
            raise EngineUnavailable(f"cannot connect to {what}: {exc.strerror or exc}") from exc
        protocol.address = address
        return protocol

    async def send(
        self,
        method: str,
        url: str,
        content: bytes | None,
        headers: Mapping[str, str],
        what: str,
        timeout: float | None = None,
    ) -> H1Response:
        """Send and return once the response head arrived. ``timeout`` starts once a
        connection is at hand (a new one has the connect timeout of its own)."""
        if self._closed:
            raise EngineUnavailable("the router's engine client is closed")
        address, target = _target(url)
        connection = await self._checkout(address, what)
        deadline = None if timeout is None else connection.loop.time() + timeout
        head = [method.encode("latin-1"), b" ", target]
        for name, value in headers.items():
            head.append(f"{name}: {value}\r\n".encode("latin-1"))
        if content is not None:
            head.append(b"Content-Length: %d\r\n" % len(content))
        head.append(b"\r\n")
        response = H1Response(connection, self, what, deadline)
        try:
            connection.send(b"".join(head), content)
            while not connection.head_done:
                if connection.error is not None:
                    raise response._broke()
                await connection.wait(deadline=deadline)
        except BaseException:
            await response.close()
            raise
        response.status = connection.status
        return response

    def release(self, connection: _Connection) -> None:
        if self._closed or not connection.reusable():
            connection._close()
            return
        now = self._clock()
        connection.idle_since = now
        idle = self._idle.setdefault(connection.address, [])
        if idle and self._stale(idle[0], now):
            # The oldest are at the bottom of the stack, where light traffic never reaches:
            # close and drop them here, so a burst's connections do not stay open for good.
            for old in idle:
                if self._stale(old, now):
                    old._close()
            idle[:] = [c for c in idle if not c.closed]
        idle.append(connection)

    def _stale(self, connection: _Connection, now: float) -> bool:
        return connection.closed or now - connection.idle_since > self._keepalive

    def idle_connections(self) -> int:
        return sum(len(idle) for idle in self._idle.values())

    async def aclose(self) -> None:
        self._closed = True
        for idle in self._idle.values():
            for connection in idle:
                connection._close()
        self._idle.clear()
