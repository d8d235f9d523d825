"""``Wire`` over any httpx transport: the in-process tests' fake engines (router/engines/wire.py)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Mapping

import httpx

from carryover.router.config import Timeouts
from carryover.router.engines.wire import WireResponse
from carryover.router.errors import EngineFailed, EngineTimeout, EngineUnavailable, UpstreamError

__all__ = ["HttpxWire"]


def _httpx_error(exc: httpx.TransportError, what: str) -> UpstreamError:
    if isinstance(exc, httpx.ConnectError):
        return EngineUnavailable(f"cannot connect to {what}")
    if isinstance(exc, httpx.ConnectTimeout | httpx.PoolTimeout):
        return EngineUnavailable(f"cannot connect to {what} in time")
    if isinstance(exc, httpx.TimeoutException):
        return EngineTimeout(f"{what} timed out: {exc}")
    return EngineFailed(f"{what} broke off: {type(exc).__name__}")


class _HttpxResponse:
    __slots__ = ("_deadline", "_response", "_what", "status")

    def __init__(self, response: httpx.Response, what: str, deadline: float | None) -> None:
        self._response = response
        self._what = what
        self._deadline = deadline
        self.status = response.status_code

    async def read(self) -> bytes:
        try:
            async with asyncio.timeout_at(self._deadline):
                return await self._response.aread()
        except httpx.TransportError as exc:
            raise _httpx_error(exc, self._what) from exc
        finally:
            await self._response.aclose()

    async def events(self, idle_timeout: float) -> AsyncIterator[bytes]:
        lines = self._response.aiter_lines()
        try:
            while True:
                try:
                    async with asyncio.timeout(idle_timeout):
                        line = await anext(lines)
                except StopAsyncIteration:
                    return
                except TimeoutError as exc:
                    raise EngineTimeout(f"{self._what} stalled for {idle_timeout:g} s") from exc
                if line.startswith("data:"):
                    yield line[5:].lstrip(" ").encode()
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
        self,
        method: str,
        url: str,
        content: bytes | None,
        headers: Mapping[str, str],
        what: str,
        timeout: float | None = None,
    ) -> WireResponse:
        request = httpx.Request(
            method, url, content=content, headers=headers, extensions={"timeout": self._timeout}
        )
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        try:
            async with asyncio.timeout_at(deadline):
                response = await self._transport.handle_async_request(request)
        except httpx.TransportError as exc:
            raise _httpx_error(exc, what) from exc
        response.request = request
        return _HttpxResponse(response, what, deadline)

    async def aclose(self) -> None:
        await self._transport.aclose()
