"""The simulated NIXL side channel: how one instance reads another's KV blocks.

A handle names the holder by its side-channel address (``remote_host``/``remote_port``) and
``remote_engine_id``. The reader connects there and asks for the listed blocks; the holder
checks the engine id (a restarted engine has a new one), the expiry deadline on its own clock,
and answers with the blocks' contents. Frames: 4-byte big-endian length, then msgpack.
"""

from __future__ import annotations

import asyncio
import struct
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec

__all__ = ["SideChannelError", "read_remote", "serve_side_channel"]

_HEADER = struct.Struct(">I")
_MAX_FRAME = 64 << 20


class SideChannelError(Exception):
    """The remote read failed: ``kind`` is ``disconnect``, ``engine_mismatch``, ``expired`` or
    ``bad_request``."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


async def _read_frame(reader: asyncio.StreamReader) -> Any:
    (size,) = _HEADER.unpack(await reader.readexactly(_HEADER.size))
    if size > _MAX_FRAME:
        raise SideChannelError("bad_request", "frame too large")
    return msgspec.msgpack.decode(await reader.readexactly(size))


def _frame(message: Any) -> bytes:
    body = msgspec.msgpack.encode(message)
    return _HEADER.pack(len(body)) + body


Handler = Callable[[dict[str, Any]], Awaitable[dict[str, Any]]]


async def serve_side_channel(host: str, port: int, handler: Handler) -> asyncio.Server:
    async def connection(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                try:
                    request = await _read_frame(reader)
                except (asyncio.IncompleteReadError, ConnectionError):
                    return
                try:
                    reply = await handler(request)
                except SideChannelError as exc:
                    reply = {"error": exc.kind, "message": str(exc)}
                writer.write(_frame(reply))
                await writer.drain()
        finally:
            writer.close()

    return await asyncio.start_server(connection, host, port, reuse_address=True)


async def read_remote(host: str, port: int, request: dict[str, Any], timeout: float) -> Any:
    """One request/answer exchange with a holder."""
    try:
        async with asyncio.timeout(timeout):
            reader, writer = await asyncio.open_connection(host, port)
            try:
                writer.write(_frame(request))
                await writer.drain()
                reply = await _read_frame(reader)
            finally:
                writer.close()
    except (OSError, asyncio.IncompleteReadError, TimeoutError) as exc:
        raise SideChannelError("disconnect", f"NIXL_ERR_REMOTE_DISCONNECT: {exc}") from exc
    if not isinstance(reply, dict):
        raise SideChannelError("bad_request", "malformed reply")
    if "error" in reply:
        raise SideChannelError(str(reply["error"]), str(reply.get("message", "")))
    return reply
