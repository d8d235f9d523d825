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

from carryover.router.errors import ClientGone
from carryover.router.turn import DONE_FRAME, Relay

__all__ = ["Answer", "DisconnectWatch", "EventStream"]


def _headers(media_type: bytes, headers: dict[str, str]) -> list[tuple[bytes, bytes]]:
    return [
        (b"content-type", media_type),
        *((k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in headers.items()),
    ]


class DisconnectWatch:
    """Cancels the guarded task when the client disconnects: one watcher task per request,
    for the turn (``guard(raise_gone=True)``, up to its answer or first chunk) and then the
    stream's relay (``guard(raise_gone=False)``). A watcher per phase cost a stream turn
    3.5% of its instructions (``bench/RESULTS.md``).

    On leaving a guard, a cancellation the watch caused becomes ``ClientGone`` (``raise_gone``)
    or is swallowed; any other outcome goes on as it was, even when the client left in
    between (an answer already made still goes out). A client that left between two guards
    cancels the second at once. ``close`` ends the watcher (the request's handler calls it
    last)."""

    __slots__ = ("_cancelled", "_guarding", "_left", "_raise", "_receive", "_task", "_watcher")

    def __init__(self, receive: Receive) -> None:
        self._receive = receive
        self._task: asyncio.Task[object] | None = None
        self._watcher: asyncio.Future[None] | None = None
        self._guarding = False
        self._raise = True
        self._cancelled = False  # the guarded task was cancelled by this watch
        self._left = False

    def guard(self, *, raise_gone: bool) -> DisconnectWatch:
        self._raise = raise_gone
        return self

    def __enter__(self) -> DisconnectWatch:
        task = asyncio.current_task()
        assert task is not None
        self._task = task
        self._guarding = True
        if self._watcher is None:
            # The guarded task's own loop (ensure_future would look the running loop up again).
            self._watcher = task.get_loop().create_task(self._until_gone())
            self._watcher.add_done_callback(self._gone)
        elif self._left:
            self._cancel()
        return self

    async def _until_gone(self) -> None:
        while (await self._receive())["type"] != "http.disconnect":
            pass

    def _gone(self, watcher: asyncio.Future[None]) -> None:
        if watcher.cancelled() or watcher.exception() is not None:
            return
        self._left = True
        if self._guarding:
            self._cancel()

    def _cancel(self) -> None:
        if not self._cancelled and self._task is not None:
            self._cancelled = True
            self._task.cancel()

    def __exit__(
        self,
        kind: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool:
        self._guarding = False
        if not self._cancelled:
            return False
        self._cancelled = False
        assert self._task is not None
        remaining = self._task.uncancel()
        if kind is not None and issubclass(kind, asyncio.CancelledError) and remaining == 0:
            if self._raise:
                raise ClientGone("the client disconnected before the answer") from None
            return True
        return False

    def close(self) -> None:
        self._guarding = False
        if self._watcher is not None:
            self._watcher.cancel()
            # The cancelled watcher keeps its CancelledError, whose traceback holds this
            # watch: without this, every request left a cycle (with the server's request
            # cycle in it) for a full collection to find.
            self._watcher = None
        self._task = None


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

    __slots__ = ("_chunks", "_headers", "_on_close", "_watch")

    def __init__(
        self,
        chunks: Relay,
        headers: dict[str, str],
        on_close: Callable[[], None],
        watch: DisconnectWatch,
    ):
        self._chunks = chunks
        self._headers = _headers(b"text/event-stream", {**headers, "Cache-Control": "no-cache"})
        self._on_close = on_close
        self._watch = watch

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            with self._watch.guard(raise_gone=False):
                await send({"type": "http.response.start", "status": 200, "headers": self._headers})
                chunks = self._chunks
                if chunks.first:  # empty: a stream that had no frame for the client
                    body = chunks.first
                    await send({"type": "http.response.body", "body": body, "more_body": True})
                async for chunk in chunks.rest:
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
                # The relay is over (committed, its lease and connection released) before the
                # client can see the response complete: [DONE] goes out with the body's end.
                await send({"type": "http.response.body", "body": DONE_FRAME, "more_body": False})
        finally:
            try:
                await self._chunks.rest.aclose()
            finally:
                self._on_close()
