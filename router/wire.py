"""The bytes on the way to an engine: one request out, its status and body back, with every
transport error mapped to the router's vocabulary (``router/errors.py``) where it happens.

Two wires, one contract. ``AiohttpWire`` is the production path: one aiohttp session, pooled
keep-alive HTTP/1.1 connections to every instance, no request or response objects beyond
aiohttp's own. ``HttpxWire`` runs any httpx transport, which is how the in-process tests put
fake engines on this seam (``tests/unit/router/fakes.py``). The classification is the same:
a connection that could not be made, or not in time, means the request was never sent
(``EngineUnavailable``: it may go again); a read that stalls is ``EngineTimeout``; anything
that breaks a started exchange is ``EngineFailed``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from typing import Protocol

import aiohttp
import httpx
from aiohttp.http_exceptions import LineTooLong

from router.config import Timeouts
from router.errors import EngineFailed, EngineTimeout, EngineUnavailable, UpstreamError

__all__ = ["AiohttpWire", "HttpxWire", "Wire", "WireResponse"]

#: The longest SSE line read from an engine. aiohttp's ``readline`` stops at twice its read
#: buffer (512 KiB in aiohttp 3.14), and a D stream's first chunk carries the whole prompt's
#: ids (about 7 bytes a token: 512 KiB is a 75k-token prompt).
_MAX_LINE = 64 * 1024 * 1024


class WireResponse(Protocol):
    status: int

    async def read(self) -> bytes:
        """The whole body (then the connection goes back to the pool)."""
        ...

    def lines(self) -> AsyncIterator[str]:
        """The body line by line, without line endings."""
        ...

    async def close(self) -> None: ...


class Wire(Protocol):
    async def send(
        self, method: str, url: str, content: bytes | None, headers: Mapping[str, str], what: str
    ) -> WireResponse:
        """Send and return once the response head arrived; ``what`` names the target in
        errors."""
        ...

    async def aclose(self) -> None: ...


# -- aiohttp ---------------------------------------------------------------------------------


def _aiohttp_error(exc: aiohttp.ClientError | TimeoutError, what: str) -> UpstreamError:
    if isinstance(exc, aiohttp.ConnectionTimeoutError):
        # No connection within the deadline: the request was never sent, so it may go again,
        # to this instance too (unlike a timeout while the engine runs it).
        return EngineUnavailable(f"cannot connect to {what} in time")
    if isinstance(exc, aiohttp.ClientConnectorError):
        return EngineUnavailable(f"cannot connect to {what}")
    if isinstance(exc, TimeoutError):
        # aiohttp's message names the timer (reading the socket, say).
        return EngineTimeout(f"{what} timed out: {exc}")
    return EngineFailed(f"{what} broke off: {type(exc).__name__}")


class _AiohttpResponse:
    __slots__ = ("_response", "_what", "status")

    def __init__(self, response: aiohttp.ClientResponse, what: str) -> None:
        self._response = response
        self._what = what
        self.status = response.status

    async def read(self) -> bytes:
        try:
            return await self._response.read()
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise _aiohttp_error(exc, self._what) from exc
        finally:
            self._response.release()

    async def lines(self) -> AsyncIterator[str]:
        content = self._response.content
        while True:
            try:
                line = await content.readuntil(b"\n", max_size=_MAX_LINE)
            except (aiohttp.ClientError, TimeoutError) as exc:
                raise _aiohttp_error(exc, self._what) from exc
            except LineTooLong as exc:
                raise EngineFailed(f"{self._what} sent a line over {_MAX_LINE} bytes") from exc
            if not line:
                return
            yield line.rstrip(b"\r\n").decode()

    async def close(self) -> None:
        self._response.release()


class AiohttpWire:
    """One session for every engine: keep-alive connections closed after
    ``timeouts.keepalive`` idle seconds (below vLLM's own 5 s, so the engine never closes one
    under a request being sent)."""

    def __init__(self, timeouts: Timeouts) -> None:
        self._timeouts = timeouts
        self._session: aiohttp.ClientSession | None = None

    def _open(self) -> aiohttp.ClientSession:
        # Created on first use: a session belongs to the running event loop.
        connector = aiohttp.TCPConnector(
            limit=1024, keepalive_timeout=self._timeouts.keepalive, ttl_dns_cache=None
        )
        timeout = aiohttp.ClientTimeout(
            total=None,
            connect=self._timeouts.connect,  # a free connection from the pool, or a new one
            sock_connect=self._timeouts.connect,
            sock_read=self._timeouts.request,
        )
        return aiohttp.ClientSession(
            connector=connector,
            timeout=timeout,
            auto_decompress=False,
            skip_auto_headers=("User-Agent",),
        )

    async def send(
        self, method: str, url: str, content: bytes | None, headers: Mapping[str, str], what: str
    ) -> WireResponse:
        session = self._session or self._open()
        self._session = session
        try:
            response = await session.request(method, url, data=content, headers=headers)
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise _aiohttp_error(exc, what) from exc
        return _AiohttpResponse(response, what)

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None


# -- httpx -----------------------------------------------------------------------------------


def _httpx_error(exc: httpx.TransportError, what: str) -> UpstreamError:
    """By the transport's own exception where it carries one (an aiohttp cause, as the fake
    engines raise them), else by httpx's class."""
    cause = exc.__cause__
    if isinstance(cause, aiohttp.ClientError | TimeoutError):
        return _aiohttp_error(cause, what)
    if isinstance(exc, httpx.ConnectError):
        return EngineUnavailable(f"cannot connect to {what}")
    if isinstance(exc, httpx.ConnectTimeout | httpx.PoolTimeout):
        return EngineUnavailable(f"cannot connect to {what} in time")
    if isinstance(exc, httpx.TimeoutException):
        return EngineTimeout(f"{what} timed out: {exc}")
    return EngineFailed(f"{what} broke off: {type(exc).__name__}")


class _HttpxResponse:
    __slots__ = ("_response", "_what", "status")

    def __init__(self, response: httpx.Response, what: str) -> None:
        self._response = response
        self._what = what
        self.status = response.status_code

    async def read(self) -> bytes:
        try:
            return await self._response.aread()
        except httpx.TransportError as exc:
            raise _httpx_error(exc, self._what) from exc
        finally:
            await self._response.aclose()

    async def lines(self) -> AsyncIterator[str]:
        try:
            async for line in self._response.aiter_lines():
                yield line
        except httpx.TransportError as exc:
            raise _httpx_error(exc, self._what) from exc

    async def close(self) -> None:
        await self._response.aclose()


class HttpxWire:
    def __init__(self, transport: httpx.AsyncBaseTransport, timeouts: Timeouts) -> None:
        self._transport = transport
        self._timeout = {
            "connect": timeouts.connect,
            "read": timeouts.request,
            "write": timeouts.request,
            "pool": timeouts.connect,
        }

    async def send(
        self, method: str, url: str, content: bytes | None, headers: Mapping[str, str], what: str
    ) -> WireResponse:
        request = httpx.Request(
            method, url, content=content, headers=headers, extensions={"timeout": self._timeout}
        )
        try:
            response = await self._transport.handle_async_request(request)
        except httpx.TransportError as exc:
            raise _httpx_error(exc, what) from exc
        response.request = request
        return _HttpxResponse(response, what)

    async def aclose(self) -> None:
        await self._transport.aclose()
