"""Calls to engines: one pooled httpx client on the aiohttp transport, errors mapped once.

Plain httpx measured 3-5x slower than this transport on the reference machine
(``reference/env.md`` §2), which matters for router overhead, not for correctness.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from typing import Any

import httpx
import msgspec
from httpx_aiohttp import AiohttpTransport

from router.config import Timeouts
from router.errors import EngineFailed, EngineTimeout, EngineUnavailable

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


class Upstream:
    """Pooled keep-alive connections to every instance."""

    def __init__(
        self, timeouts: Timeouts, transport: httpx.AsyncBaseTransport | None = None
    ) -> None:
        self.timeouts = timeouts
        limits = httpx.Limits(
            max_connections=1024, max_keepalive_connections=256, keepalive_expiry=30
        )
        self._client = httpx.AsyncClient(
            transport=transport or AiohttpTransport(limits=limits),
            timeout=httpx.Timeout(timeouts.request, connect=timeouts.connect),
        )

    async def aclose(self) -> None:
        await self._client.aclose()

    async def post_json(
        self,
        url: str,
        body: Mapping[str, Any],
        *,
        timeout: float,
        headers: Mapping[str, str] | None = None,
    ) -> Any:
        """POST JSON, return the decoded JSON body of a 2xx answer."""
        try:
            async with asyncio.timeout(timeout):
                response = await self._client.post(
                    url,
                    content=_encoder.encode(body),
                    headers={"Content-Type": "application/json", **(headers or {})},
                )
        except TimeoutError as exc:
            raise EngineTimeout(f"{url} did not answer within {timeout:g} s") from exc
        except httpx.ConnectError as exc:
            raise EngineUnavailable(f"cannot connect to {url}") from exc
        except httpx.TimeoutException as exc:
            raise EngineTimeout(f"{url} timed out") from exc
        except httpx.TransportError as exc:
            raise EngineFailed(f"{url} broke off: {type(exc).__name__}") from exc
        if response.status_code >= 300:
            body_json = _failed_body(response.content)
            raise EngineFailed(
                _message_of(body_json, response.status_code),
                status=response.status_code,
                body=body_json,
            )
        try:
            return _decoder.decode(response.content)
        except msgspec.DecodeError as exc:
            raise EngineFailed(f"{url} answered with invalid JSON") from exc

    async def get(self, url: str, *, timeout: float) -> httpx.Response:
        try:
            async with asyncio.timeout(timeout):
                return await self._client.get(url)
        except TimeoutError as exc:
            raise EngineTimeout(f"{url} did not answer within {timeout:g} s") from exc
        except httpx.ConnectError as exc:
            raise EngineUnavailable(f"cannot connect to {url}") from exc
        except httpx.HTTPError as exc:
            raise EngineFailed(f"{url}: {type(exc).__name__}") from exc

    @asynccontextmanager
    async def stream(
        self,
        url: str,
        body: Mapping[str, Any],
        *,
        first_byte: float,
        headers: Mapping[str, str] | None = None,
    ) -> AsyncIterator[httpx.Response]:
        """POST and yield the response once its headers arrived (a 2xx only)."""
        request = self._client.build_request(
            "POST",
            url,
            content=_encoder.encode(body),
            headers={"Content-Type": "application/json", **(headers or {})},
        )
        try:
            async with asyncio.timeout(first_byte):
                response = await self._client.send(request, stream=True)
        except TimeoutError as exc:
            raise EngineTimeout(f"{url} sent nothing within {first_byte:g} s") from exc
        except httpx.ConnectError as exc:
            raise EngineUnavailable(f"cannot connect to {url}") from exc
        except httpx.TimeoutException as exc:
            raise EngineTimeout(f"{url} timed out") from exc
        except httpx.TransportError as exc:
            raise EngineFailed(f"{url} broke off: {type(exc).__name__}") from exc
        try:
            if response.status_code >= 300:
                content = await response.aread()
                body_json = _failed_body(content)
                raise EngineFailed(
                    _message_of(body_json, response.status_code),
                    status=response.status_code,
                    body=body_json,
                )
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
