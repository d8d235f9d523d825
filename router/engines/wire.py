"""The bytes on the way to an engine: one request out, its status and body back, with every
transport error mapped to the router's vocabulary (``router/errors.py``) where it happens.

Two wires, one contract. ``H1Wire`` (``router/engines/h1.py``) is the production path: pooled
keep-alive HTTP/1.1 connections to every instance and nothing per request beyond the bytes.
``HttpxWire`` (``router/engines/wire_httpx.py``) runs any httpx transport, which is how the in-process
tests put fake engines on this seam (``tests/unit/router/fakes.py``); the serving process never
imports it (httpx is ~10 MiB of a worker's RSS). The classification is the same:
a connection that could not be made, or not in time, means the request was never sent
(``EngineUnavailable``: it may go again); a read that stalls is ``EngineTimeout``; anything
that breaks a started exchange is ``EngineFailed``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from typing import Protocol

__all__ = ["Wire", "WireResponse"]


class WireResponse(Protocol):
    status: int

    async def read(self) -> bytes:
        """The whole body (then the connection goes back to the pool); ``TimeoutError`` once
        the exchange's ``timeout`` (given to ``send``) has passed."""
        ...

    def events(self, idle_timeout: float) -> AsyncIterator[bytes]:
        """The ``data:`` payloads of a server-sent event body (``[DONE]`` included; other
        fields, comments and blank lines skipped); ``EngineTimeout`` when the body stalls for
        ``idle_timeout`` seconds."""
        ...

    async def close(self) -> None: ...


class Wire(Protocol):
    async def send(
        self,
        method: str,
        url: str,
        content: bytes | None,
        headers: Mapping[str, str],
        what: str,
        timeout: float | None = None,
    ) -> WireResponse:
        """Send and return once the response head arrived; ``what`` names the target in
        errors. ``timeout`` bounds the exchange from here to the end of ``read()``
        (``TimeoutError``); a streamed body's reads have their own idle timeout."""
        ...

    async def aclose(self) -> None: ...
