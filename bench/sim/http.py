"""What every simulated server's HTTP face shares: vLLM's error shape, JSON answers, and an
aiohttp app served on a loopback port."""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import msgspec
from aiohttp import web

from carryover.bench.sim.sequence import EngineError

__all__ = ["SseSender", "error", "ok", "serve"]

_json = msgspec.json.Encoder()


def error(status: int, message: str, kind: str | None = None) -> web.Response:
    """vLLM's error body (``{"error": {"message", "type", "param", "code"}}``)."""
    kind = kind or ("BadRequestError" if status < 500 else "InternalServerError")
    body = {"error": {"message": message, "type": kind, "param": None, "code": status}}
    return web.Response(status=status, body=_json.encode(body), content_type="application/json")


def ok(body: Any) -> web.Response:
    return web.Response(body=_json.encode(body), content_type="application/json")


async def serve(app: web.Application, host: str, port: int, **options: Any) -> web.AppRunner:
    """``app`` listening on ``host:port``; ``cleanup()`` the runner to stop it. A stop is a
    crash as far as clients can tell: in-flight requests are cut, not drained."""
    runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.1, **options)
    await runner.setup()
    await web.TCPSite(runner, host, port).start()
    return runner


class SseSender:
    """Writes ``data:`` events of one stream; the connection is cut (``ConnectionResetError``)
    once ``drop_after()`` events went out, as an engine that dies mid-stream (the fault may
    be set while the stream runs, so it is read at every event)."""

    def __init__(
        self,
        request: web.Request,
        response: web.StreamResponse,
        drop_after: Callable[[], int | None],
    ) -> None:
        self._request = request
        self._response = response
        self._drop_after = drop_after
        self.sent = 0

    async def send(self, payload: dict[str, Any]) -> None:
        drop = self._drop_after()
        if drop is not None and self.sent >= drop:
            assert self._request.transport is not None
            self._request.transport.close()
            raise ConnectionResetError("injected stream drop")
        await self._response.write(b"data: " + _json.encode(payload) + b"\n\n")
        self.sent += 1

    async def fail(self, message: str, kind: str, code: int) -> None:
        """An error event and ``[DONE]``: how vLLM ends a stream that failed mid-way."""
        failure = {"error": {"message": message, "type": kind, "code": code}}
        await self._response.write(b"data: " + _json.encode(failure) + b"\n\ndata: [DONE]\n\n")

    @asynccontextmanager
    async def ending(self, events: AsyncGenerator[Any, None]) -> AsyncIterator[None]:
        """Ends the stream written inside as vLLM does: an engine error becomes an error event
        and ``[DONE]``; a cut connection closes ``events`` (the sequence is aborted) and gets
        no end of body."""
        try:
            yield
        except EngineError as exc:
            await self.fail(str(exc), exc.kind, exc.status)
        except ConnectionResetError:
            await events.aclose()
            return
        await self._response.write_eof()
