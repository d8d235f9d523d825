"""What the OpenAI endpoints send back, as bare ASGI apps, and the watch that stops a turn whose
client has gone.

Every turn sends one of these, so they skip what Litestar's ``Response`` and ``Stream`` add
on the way (response objects, header normalization, and for streams an anyio task group and
a second task per request; ``bench/RESULTS.md`` has what that cost). Errors still go
through the app's exception handlers: these only carry answers.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from types import TracebackType

from litestar.types import Receive, Scope, Send

from router.errors import ClientGone
from router.turn import DONE_FRAME, Relay

__all__ = ["Answer", "CancelOnDisconnect", "EventStream"]


def _headers(media_type: bytes, headers: dict[str, str]) -> list[tuple[bytes, bytes]]:
    return [
        (b"content-type", media_type),
        *((k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in headers.items()),
    ]


class CancelOnDisconnect:
    """While open, the client's disconnect cancels the task that opened it.

    On leaving, a cancellation this watch caused becomes ``ClientGone`` (``raise_gone``) or
    is swallowed; any other outcome goes on as it was, even when the client
    left in between (an answer already made still goes out). One task per watch: the turn
    itself keeps running in the caller's."""

    def __init__(self, receive: Receive, *, raise_gone: bool = True) -> None:
        self._receive = receive
        self._raise = raise_gone
        self._open = False
        self.left = False

    def __enter__(self) -> CancelOnDisconnect:
        task = asyncio.current_task()
        assert task is not None
        self._task = task
        self._open = True
        self._watcher = asyncio.ensure_future(self._until_gone())
        self._watcher.add_done_callback(self._gone)
        return self

    async def _until_gone(self) -> None:
        while (await self._receive())["type"] != "http.disconnect":
            pass

    def _gone(self, watcher: asyncio.Future[None]) -> None:
        if self._open and not watcher.cancelled() and watcher.exception() is None:
            self.left = True
            self._task.cancel()

    def __exit__(
        self,
        kind: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool:
        self._open = False
        self._watcher.cancel()
        if not self.left:
            return False
        remaining = self._task.uncancel()
        if kind is not None and issubclass(kind, asyncio.CancelledError) and remaining == 0:
            if self._raise:
                raise ClientGone("the client disconnected before the answer") from None
            return True
        return False


class Answer:
    """A whole JSON answer."""

    __slots__ = ("_body", "_headers")

    def __init__(self, body: bytes, headers: dict[str, str]) -> None:
        self._body = body
        self._headers = _headers(b"application/json", headers)
        self._headers.append((b"content-length", str(len(body)).encode()))

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": self._headers})
        await send({"type": "http.response.body", "body": self._body, "more_body": False})


class EventStream:
    """A started turn's SSE relay. However it ends (done, the client gone, an error) the
    relay is closed, which ends the turn's lease, connection and span, and ``on_close``
    runs once."""

    __slots__ = ("_chunks", "_headers", "_on_close")

    def __init__(self, chunks: Relay, headers: dict[str, str], on_close: Callable[[], None]):
        self._chunks = chunks
        self._headers = _headers(b"text/event-stream", {**headers, "Cache-Control": "no-cache"})
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            with CancelOnDisconnect(receive, raise_gone=False):
                await send({"type": "http.response.start", "status": 200, "headers": self._headers})
                chunks = self._chunks
                await send({"type": "http.response.body", "body": chunks.first, "more_body": True})
                ended = False
                async for chunk in chunks.rest:
                    # [DONE] is the turn's last frame: it goes out with the body's end, in
                    # one write to the client.
                    ended = chunk == DONE_FRAME
                    await send(
                        {"type": "http.response.body", "body": chunk, "more_body": not ended}
                    )
                if not ended:
                    await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            try:
                await self._chunks.aclose()
            finally:
                self._on_close()
