"""Calls to engines: httpx requests on the aiohttp transport, errors mapped once.

Plain httpx measured 3-5x slower than this transport on the reference machine
(measured with a client microbenchmark on a 2-core machine). The transport is called directly: the client's redirect, auth and
cookie layers cost about 100 µs a call and do nothing for engine calls.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from typing import Any

import aiohttp
import httpx
import msgspec
from httpx_aiohttp import AiohttpTransport

from router.config import Timeouts
from router.errors import EngineFailed, EngineTimeout, EngineUnavailable, UpstreamError

__all__ = ["Upstream", "iter_sse"]

_encoder = msgspec.json.Encoder()
_decoder = msgspec.json.Decoder()


def _failed_body(content: bytes) -> Any:
    try:
        return _decoder.decode(content)
    except msgspec.DecodeError:
        return content[:512].decode("utf-8", "replace")


def _message_of(body: Any, status: int) -> str:
    if isinstance(body, dict) and isinstance(body.get("error"), dict):
        return str(body["error"].get("message") or f"engine answered {status}")
    if isinstance(body, dict) and "message" in body:
        return str(body["message"])
    return f"engine answered HTTP {status}"


def _transport_error(exc: httpx.TransportError, what: str) -> UpstreamError:
    """Classify by the transport's own exception: the aiohttp transport maps every closed
    connection (``ServerDisconnectedError``) to ``httpx.ConnectTimeout``, which is neither."""
    cause = exc.__cause__
    if isinstance(cause, aiohttp.ClientConnectorError) or (
        cause is None and isinstance(exc, httpx.ConnectError)
    ):
        return EngineUnavailable(f"cannot connect to {what}")
    if isinstance(cause, aiohttp.ConnectionTimeoutError) or (
        cause is None and isinstance(exc, httpx.ConnectTimeout | httpx.PoolTimeout)
    ):
        # No connection within the deadline: the request was never sent, so it may go again,
        # to this instance too (unlike a timeout while the engine runs it).
        return EngineUnavailable(f"cannot connect to {what} in time")
    if isinstance(cause, aiohttp.ServerTimeoutError | TimeoutError) or (
        cause is None and isinstance(exc, httpx.TimeoutException)
    ):
        # aiohttp's message names the timer (connecting, or reading the socket).
        return EngineTimeout(f"{what} timed out: {cause or exc}")
    return EngineFailed(f"{what} broke off: {type(cause or exc).__name__}")


class Upstream:
    """Pooled keep-alive connections to every instance."""

    def __init__(
        self, timeouts: Timeouts, transport: httpx.AsyncBaseTransport | None = None
    ) -> None:
        self.timeouts = timeouts
        limits = httpx.Limits(
            max_connections=1024, max_keepalive_connections=256, keepalive_expiry=timeouts.keepalive
        )
        self._transport = transport or AiohttpTransport(limits=limits)
        self._urls: dict[str, httpx.URL] = {}
        self._timeout = {
            "connect": timeouts.connect,
            "read": timeouts.request,
            "write": timeouts.request,
            "pool": timeouts.connect,
        }

    async def aclose(self) -> None:
        await self._transport.aclose()

    def _url(self, url: str) -> httpx.URL:
        # httpx parses URLs in Python (~150 µs each); engines are few, their paths fewer.
        parsed = self._urls.get(url)
        if parsed is None:
            if len(self._urls) > 4096:
                self._urls.clear()
            parsed = self._urls[url] = httpx.URL(url)
        return parsed

    def _request(
        self,
        method: str,
        url: str,
        body: Mapping[str, Any] | None,
        headers: Mapping[str, str] | None,
    ) -> httpx.Request:
        all_headers = dict(headers or {})
        content = None
        if body is not None:
            content = _encoder.encode(body)
            all_headers["Content-Type"] = "application/json"
        return httpx.Request(
            method,
            self._url(url),
            content=content,
            headers=all_headers,
            extensions={"timeout": self._timeout},
        )

    async def _send(self, request: httpx.Request, what: str, timeout: float) -> httpx.Response:
        """Send and wait for the response head; map every transport error."""
        try:
            async with asyncio.timeout(timeout):
                response = await self._transport.handle_async_request(request)
        except TimeoutError as exc:
            raise EngineTimeout(f"{what} did not answer within {timeout:g} s") from exc
        except httpx.TransportError as exc:
            raise _transport_error(exc, what) from exc
        response.request = request
        return response

    async def _read(self, response: httpx.Response, what: str, timeout: float) -> bytes:
        try:
            async with asyncio.timeout(timeout):
                return await response.aread()
        except TimeoutError as exc:
            raise EngineTimeout(f"{what} did not finish within {timeout:g} s") from exc
        except httpx.TransportError as exc:
            raise EngineFailed(f"{what} broke off: {type(exc).__name__}") from exc
        finally:
            await response.aclose()

    async def _check(self, response: httpx.Response, what: str, timeout: float) -> None:
        if response.status_code >= 300:
            body = _failed_body(await self._read(response, what, timeout))
            raise EngineFailed(
                _message_of(body, response.status_code), status=response.status_code, body=body
            )

    async def post_json(
        self,
        url: str,
        body: Mapping[str, Any],
        *,
        timeout: float,
        headers: Mapping[str, str] | None = None,
    ) -> Any:
        """POST JSON, return the decoded JSON body of a 2xx answer."""
        deadline = asyncio.get_running_loop().time() + timeout
        response = await self._send(self._request("POST", url, body, headers), url, timeout)
        remaining = max(0.001, deadline - asyncio.get_running_loop().time())
        await self._check(response, url, remaining)
        content = await self._read(response, url, remaining)
        try:
            return _decoder.decode(content)
        except msgspec.DecodeError as exc:
            raise EngineFailed(f"{url} answered with invalid JSON") from exc

    async def get(self, url: str, *, timeout: float) -> httpx.Response:
        """GET; the response's body is read (``.text``/``.json()`` work), whatever its status."""
        response = await self._send(self._request("GET", url, None, None), url, timeout)
        await self._read(response, url, timeout)
        return response

    @asynccontextmanager
    async def stream(
        self,
        url: str,
        body: Mapping[str, Any],
        *,
        first_byte: float,
        headers: Mapping[str, str] | None = None,
    ) -> AsyncIterator[httpx.Response]:
        """POST and yield the response once its head arrived (2xx only); the body streams."""
        response = await self._send(self._request("POST", url, body, headers), url, first_byte)
        try:
            await self._check(response, url, first_byte)
            yield response
        finally:
            await response.aclose()


async def iter_sse(response: httpx.Response, *, idle_timeout: float) -> AsyncIterator[str]:
    """The ``data:`` payloads of a server-sent event stream, ``[DONE]`` included.

    Raises ``EngineFailed`` if the stream breaks and ``EngineTimeout`` if it stalls.
    """
    lines = response.aiter_lines()
    while True:
        try:
            async with asyncio.timeout(idle_timeout):
                line = await anext(lines)
        except StopAsyncIteration:
            return
        except TimeoutError as exc:
            raise EngineTimeout(f"stream stalled for {idle_timeout:g} s") from exc
        except httpx.HTTPError as exc:
            raise EngineFailed(f"stream broke off: {type(exc).__name__}") from exc
        if line.startswith("data:"):
            yield line[5:].lstrip(" ")
