"""Calls to engines: JSON in, JSON (or an SSE stream) out, with deadlines, over a wire
(``router/engines/wire.py``).

The production wire is the router's own HTTP/1.1 client (``router/engines/h1.py``): httpx on an
aiohttp transport, then aiohttp alone, each cost more CPU per engine call than the rest of a
turn, and a turn makes two (``bench/RESULTS.md``, router overhead). httpx stays where it
serves: the wire the in-process tests' fake engines plug into, the tests, and the benchmark's
clients.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import msgspec

from carryover.router.config import Timeouts
from carryover.router.engines.h1 import H1Wire
from carryover.router.engines.wire import Wire, WireResponse
from carryover.router.errors import EngineFailed, EngineTimeout

if TYPE_CHECKING:
    import httpx

__all__ = ["Fetched", "Upstream"]

_encoder = msgspec.json.Encoder()
_decoder = msgspec.json.Decoder()
_JSON = {"Content-Type": "application/json"}


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


@dataclass(frozen=True, slots=True)
class Fetched:
    """A whole answer to a GET, whatever its status."""

    status_code: int
    content: bytes

    @property
    def text(self) -> str:
        return self.content.decode("utf-8", "replace")

    def json(self) -> Any:
        return _decoder.decode(self.content)


class Upstream:
    """Pooled keep-alive connections to every instance."""

    def __init__(
        self, timeouts: Timeouts, transport: httpx.AsyncBaseTransport | None = None
    ) -> None:
        self.timeouts = timeouts
        self._wire: Wire
        if transport is not None:  # in-process fakes only: the serving path never loads httpx
            from carryover.router.engines.wire_httpx import HttpxWire

            self._wire = HttpxWire(transport, timeouts)
        else:
            self._wire = H1Wire(connect_timeout=timeouts.connect, keepalive=timeouts.keepalive)

    async def aclose(self) -> None:
        await self._wire.aclose()

    async def _send(
        self,
        method: str,
        url: str,
        content: bytes | None,
        headers: Mapping[str, str],
        timeout: float,
    ) -> WireResponse:
        """Send and wait for the response head; the wire maps its own errors. ``timeout``
        bounds the exchange up to the end of the body's ``read()``."""
        try:
            return await self._wire.send(method, url, content, headers, url, timeout)
        except TimeoutError as exc:
            raise EngineTimeout(f"{url} did not answer within {timeout:g} s") from exc

    @staticmethod
    async def _read(response: WireResponse, what: str, timeout: float) -> bytes:
        try:
            return await response.read()  # within the timeout the exchange was sent with
        except TimeoutError as exc:
            raise EngineTimeout(f"{what} did not finish within {timeout:g} s") from exc
        finally:
            await response.close()

    async def _check(self, response: WireResponse, what: str, timeout: float) -> None:
        if response.status >= 300:
            body = _failed_body(await self._read(response, what, timeout))
            raise EngineFailed(
                _message_of(body, response.status), status=response.status, body=body
            )

    @staticmethod
    def _headers(headers: Mapping[str, str] | None) -> Mapping[str, str]:
        return {**headers, **_JSON} if headers else _JSON

    async def post_json(
        self,
        url: str,
        body: Mapping[str, Any],
        *,
        timeout: float,
        headers: Mapping[str, str] | None = None,
        decode: Callable[[bytes], Any] | None = None,
    ) -> Any:
        """POST JSON, return the decoded JSON body of a 2xx answer (by ``decode`` when
        given: a typed answer); ``timeout`` bounds the whole exchange (one timer in the wire,
        no ``asyncio.timeout`` scope: this runs twice a turn)."""
        response = await self._send(
            "POST", url, _encoder.encode(body), self._headers(headers), timeout
        )
        content = await self._read(response, url, timeout)
        if response.status >= 300:
            failed = _failed_body(content)
            raise EngineFailed(
                _message_of(failed, response.status), status=response.status, body=failed
            )
        try:
            return (decode or _decoder.decode)(content)
        except msgspec.DecodeError as exc:
            raise EngineFailed(f"{url} answered with invalid JSON") from exc

    async def get(self, url: str, *, timeout: float) -> Fetched:
        """GET; the whole answer, whatever its status."""
        response = await self._send("GET", url, None, {}, timeout)
        return Fetched(response.status, await self._read(response, url, timeout))

    @asynccontextmanager
    async def stream(
        self,
        url: str,
        body: Mapping[str, Any],
        *,
        first_byte: float,
        headers: Mapping[str, str] | None = None,
    ) -> AsyncIterator[WireResponse]:
        """POST and yield the response once its head arrived (2xx only); the body streams."""
        response = await self._send(
            "POST", url, _encoder.encode(body), self._headers(headers), first_byte
        )
        try:
            await self._check(response, url, first_byte)
            yield response
        finally:
            await response.close()
