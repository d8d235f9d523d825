"""One pipelined Redis connection per event loop, for the store's few commands.

redis-py's asyncio client spends about 100 µs of CPU on an ``EVALSHA`` round trip (a pooled
connection checked out and back, command packing, a stream reader, response callbacks); a
turn makes two. This channel writes each command as one RESP frame on a shared connection and
parses replies with hiredis (the parser redis-py uses), resolving callers in order:
about 25 µs a call, and concurrent turns pipeline on the one socket instead of holding one
connection each (``bench/RESULTS.md``, router overhead).

Failure model, the same as the store's: a call has a deadline (the caller's); a call that
runs out is abandoned and its late reply discarded, so one slow reply does not fail the calls
queued behind it. A connection that has answered nothing for ``dead_after`` while calls wait
(a frozen or vanished server) is closed, failing what waits on it, and the next call
reconnects. Nothing is retried except ``EVALSHA`` after ``NOSCRIPT`` (the script did not run).

The router does not import redis-py: its package costs a worker ~20 MiB of RSS for the few
lines of URL parsing and the error classes used here.
"""

from __future__ import annotations

import asyncio
import hashlib
import re
import ssl
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any, cast
from urllib.parse import parse_qs, unquote, urlsplit

import hiredis

from carryover.state.follow import SharedFollow
from carryover.state.loops import RunningLoop

__all__ = [
    "Address",
    "Arg",
    "ReplyError",
    "RespChannel",
    "RespConnectionError",
    "RespError",
    "RespNotSent",
    "RespProtocolError",
    "RespTlsError",
    "Script",
    "Tls",
    "pack",
    "redacted_url",
]


class RespError(Exception):
    """Any failed call."""


class ReplyError(RespError):
    """The server answered with an error (``NOSCRIPT``, ``NOAUTH``, a wrong command)."""


class RespConnectionError(RespError):
    """No connection, or it broke while the call waited."""


class RespNotSent(RespConnectionError):
    """No connection to send on: the command never reached a server, so it may be sent again
    (elsewhere, after a failover) without running twice."""


class RespTlsError(RespConnectionError):
    """The TLS handshake failed (a CA that did not sign the server's certificate, a name
    that does not match): a configuration error, not an outage; never retried."""


class RespProtocolError(RespError):
    """Bytes that are not RESP: the connection cannot be trusted."""


Arg = bytes | str | int | float


def pack(args: Sequence[Arg]) -> bytes:
    """A command as one RESP array of bulk strings: hiredis's packer (in C, a third of the
    time), numbers written as ``str`` writes them."""
    try:
        # (hiredis's stub types the tuple as holding one item)
        frame: bytes = hiredis.pack_command(tuple(args))  # type: ignore[arg-type]
    except TypeError:  # a value it does not take (a bool, say): the same frame by hand
        return _pack_by_hand(args)
    return frame


def _pack_by_hand(args: Sequence[Arg]) -> bytes:
    parts = [b"*%d\r\n" % len(args)]
    for arg in args:
        data = arg if isinstance(arg, bytes) else str(arg).encode()
        parts += (b"$%d\r\n" % len(data), data, b"\r\n")
    return b"".join(parts)


_PASSWORD_IN_URL = re.compile(r"(?P<head>//[^/@?#]*?:)[^@/?#]*@")
_SECRET_QUERY = re.compile(r"(?P<head>[?&](?:sentinel_)?password=)[^&#]*")


def redacted_url(url: str) -> str:
    """``url`` as errors and logs may show it: passwords, in the userinfo or the query
    (``sentinel_password``), replaced by ``***``."""
    shown = _PASSWORD_IN_URL.sub(r"\g<head>***@", url)
    return _SECRET_QUERY.sub(r"\g<head>***", shown)


@dataclass(frozen=True)
class Tls:
    """Files for a TLS connection: the CA that signed the server's certificate (the system's
    CAs when ``None``) and the client's own certificate and key, when the server asks for one."""

    ca_file: str | None = None
    cert_file: str | None = None
    key_file: str | None = None

    def context(self) -> ssl.SSLContext:
        """An SSL context; a file that cannot be read is a ``ValueError`` (a startup error)."""
        try:
            context = ssl.create_default_context(cafile=self.ca_file)
            if self.cert_file:
                context.load_cert_chain(self.cert_file, self.key_file)
        except (OSError, ssl.SSLError) as exc:
            raise ValueError(f"cannot load the Redis TLS files: {exc}") from exc
        return context


@dataclass(frozen=True)
class Address:
    """Where and how to connect, from a ``redis://``, ``rediss://`` or ``unix://`` URL."""

    host: str = "127.0.0.1"
    port: int = 6379
    path: str | None = None  #: a unix socket instead of host and port
    db: int = 0
    username: str | None = None
    password: str | None = None
    tls: bool = False
    tls_files: Tls = field(default_factory=Tls, compare=False)

    def at(self, host: str, port: int) -> Address:
        """The same credentials, database and TLS on another server (a Cluster or Sentinel
        node)."""
        return replace(self, host=host, port=port, path=None)

    @classmethod
    def from_url(cls, url: str) -> Address:
        """``redis://[[user]:password@]host[:port][/db]``, ``rediss://`` (TLS) or
        ``unix://[[user]:password@]/path[?db=N]``, as redis-py reads them (user and password
        percent-decoded; ``?db=`` wins over the path's)."""
        parts = urlsplit(url)
        shown = redacted_url(url)
        if parts.scheme not in ("redis", "rediss", "unix"):
            raise ValueError(f"a Redis URL starts with redis://, rediss:// or unix://: {shown!r}")
        query = parse_qs(parts.query)
        db_text = query["db"][0] if "db" in query else ""
        if not db_text and parts.scheme != "unix":
            db_text = parts.path.lstrip("/")
        try:
            db = int(db_text or 0)
        except ValueError:
            raise ValueError(f"the database of a Redis URL is a number: {shown!r}") from None
        username = unquote(parts.username) if parts.username else None
        password = unquote(parts.password) if parts.password is not None else None
        if parts.scheme == "unix":
            if not parts.path:
                raise ValueError(f"a unix:// Redis URL needs a socket path: {shown!r}")
            return cls(path=parts.path, db=db, username=username, password=password)
        return cls(
            host=parts.hostname or "127.0.0.1",
            port=parts.port or 6379,
            db=db,
            username=username,
            password=password,
            tls=parts.scheme == "rediss",
        )

    def setup(self) -> list[bytes]:
        """Commands a new connection runs before any call."""
        frames = []
        if self.password is not None:
            who = [self.username] if self.username else []
            frames.append(pack(["AUTH", *who, self.password]))
        if self.db:
            frames.append(pack(["SELECT", self.db]))
        return frames

    def __repr__(self) -> str:  # never the password
        where = self.path or f"{self.host}:{self.port}"
        return f"Address({where}, db={self.db}, tls={self.tls})"


@dataclass(frozen=True)
class Script:
    """A Lua script called by its SHA1, loaded on the first ``NOSCRIPT``."""

    text: str
    sha: str = field(init=False)  # hashed once: every call sends it

    def __post_init__(self) -> None:
        object.__setattr__(self, "sha", hashlib.sha1(self.text.encode()).hexdigest())


class _Connection(asyncio.Protocol):
    """Replies matched to calls in the order the calls were written."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._reader = hiredis.Reader(protocolError=RespProtocolError, replyError=ReplyError)
        self._waiting: deque[asyncio.Future[Any]] = deque()
        self._transport: asyncio.Transport | None = None
        #: since when the oldest waiting call has seen no reply (None: nothing waits)
        self.silent_since: float | None = None
        self.lost = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are not asyncio.Transport subclasses, but have its methods.
        self._transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        self._reader.feed(data)
        waiting = self._waiting
        while (reply := self._reader.gets()) is not False:
            if not waiting:  # a reply nobody asked for: the stream cannot be trusted
                self.close()
                return
            future = waiting.popleft()
            if not future.done():  # else its caller gave up: drop the reply
                if isinstance(reply, Exception):
                    future.set_exception(reply)
                else:
                    future.set_result(reply)
        self.silent_since = self._loop.time() if waiting else None

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        while self._waiting:
            future = self._waiting.popleft()
            if not future.done():
                future.set_exception(RespConnectionError(f"redis connection lost: {exc}"))

    def send(self, frame: bytes) -> asyncio.Future[Any]:
        if self.lost or self._transport is None:
            raise RespNotSent("redis connection closed")
        future = self._loop.create_future()
        if not self._waiting:
            self.silent_since = self._loop.time()
        self._waiting.append(future)
        self._transport.write(frame)
        return future

    def close(self) -> None:
        if self._transport is not None:
            self._transport.abort()  # connection_lost fails whatever waits
        self.lost = True


class RespChannel:
    """Redis calls over one pipelined connection of the running event loop.

    Args:
        address: the server.
        connect_timeout: seconds a connect (with AUTH and SELECT) may take.
        dead_after: seconds without any reply, while calls wait, before the connection is
            dropped.
    """

    def __init__(
        self, address: Address, *, connect_timeout: float = 1.0, dead_after: float = 1.0
    ) -> None:
        self.address = address
        self._connect_timeout = connect_timeout
        self._dead_after = dead_after
        self._connection: _Connection | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._connecting: asyncio.Future[_Connection] | None = None
        self._running = RunningLoop()
        self._follows = SharedFollow(pack)
        # Built now: a CA or key that cannot be read is a startup error, not a cold turn.
        self._ssl = address.tls_files.context() if address.tls else None

    async def call(self, *args: Arg) -> Any:
        """One command's reply; an error reply raises ``ReplyError``, a broken connection
        ``RespConnectionError``."""
        connection = self._live()
        if connection is None:
            connection = await self._connect()
        return await connection.send(pack(args))

    async def run(self, *commands: Sequence[Arg]) -> list[Any]:
        """Several commands written back to back (nothing of another caller's between them:
        ``ASKING`` before the command it is for, ``WAIT`` after the write it waits on); their
        replies in order, an error reply as a ``ReplyError`` value, not raised."""
        connection = self._live()
        if connection is None:
            connection = await self._connect()
        futures = [connection.send(pack(command)) for command in commands]
        replies: list[Any] = []
        for future in futures:  # in order: no gather (a task per reply costs more than this)
            try:
                replies.append(await future)
            except RespError as exc:
                replies.append(exc)
        return replies

    async def evalsha(self, script: Script, keys: Sequence[Arg], args: Sequence[Arg]) -> Any:
        head: list[Arg] = [len(keys), *keys, *args]
        try:
            return await self.call("EVALSHA", script.sha, *head)
        except ReplyError as exc:
            if not str(exc).startswith("NOSCRIPT"):
                raise
        return await self.call("EVAL", script.text, *head)  # runs it and caches it

    async def primaries(self) -> list[RespChannel]:
        return [self]

    async def script(
        self,
        script: Script,
        keys: Sequence[Arg],
        args: Sequence[Arg],
        *,
        before: Sequence[Arg] | None = None,
        after: Sequence[Arg] | None = None,
    ) -> tuple[Any, Any]:
        """``evalsha`` with one command written just before it (``ASKING``) and one just after
        (``WAIT``); returns the script's reply and the one after it."""
        if before is None and after is None:  # the common case: one frame, one future
            return await self.evalsha(script, keys, args), None
        head: list[Arg] = [len(keys), *keys, *args]
        if before is None and after is not None:
            return await self._script_then(script, head, after)
        for command in (["EVALSHA", script.sha, *head], ["EVAL", script.text, *head]):
            replies = await self.run(*filter(None, (before, command, after)))
            reply = replies[1 if before else 0]
            if isinstance(reply, ReplyError) and str(reply).startswith("NOSCRIPT"):
                continue  # did not run: again, as EVAL, which also caches it
            if isinstance(reply, BaseException):
                raise reply
            return reply, replies[-1] if after else None
        raise ReplyError("NOSCRIPT after EVAL")  # pragma: no cover - EVAL never answers it

    async def _script_then(
        self, script: Script, head: list[Arg], after: Sequence[Arg]
    ) -> tuple[Any, Any]:
        """The script, and ``after`` (``WAIT``) shared with the scripts written in the same
        iteration of the event loop (``state/follow.py``)."""
        for command in (["EVALSHA", script.sha, *head], ["EVAL", script.text, *head]):
            connection = self._live() or await self._connect()
            sent = connection.send(pack(command))
            follows = self._follows.after(connection, after)
            try:
                reply = await sent
            except ReplyError as exc:
                if str(exc).startswith("NOSCRIPT"):
                    continue  # did not run: again, as EVAL, which also caches it
                raise
            return reply, await follows
        raise ReplyError("NOSCRIPT after EVAL")  # pragma: no cover - EVAL never answers it

    def close(self) -> None:
        if self._connection is not None:
            self._connection.close()
            self._connection = None

    def _live(self) -> _Connection | None:
        connection = self._connection
        if connection is None or connection.lost:
            return None
        loop = self._running()
        if loop is not self._loop:  # made on another loop (a test's earlier asyncio.run)
            connection.close()
            return None
        silent = connection.silent_since
        if silent is not None and loop.time() - silent > self._dead_after:
            connection.close()
            return None
        return connection

    async def _connect(self) -> _Connection:
        # Calls that arrive while a connect is under way wait for that one.
        if self._connecting is not None and self._loop is asyncio.get_running_loop():
            return await asyncio.shield(self._connecting)
        loop = asyncio.get_running_loop()
        self._loop = loop
        self._connection = None
        self._connecting = connecting = loop.create_future()
        try:
            async with asyncio.timeout(self._connect_timeout):
                connection = await self._open(loop)
        except BaseException as exc:
            # Whoever waits on this connect gets a connection error, never another caller's
            # cancellation.
            kind = RespTlsError if isinstance(exc, ssl.SSLError) else RespNotSent
            failure = kind(f"redis connect to {self.address!r}: {type(exc).__name__}: {exc}")
            connecting.set_exception(failure)
            connecting.exception()  # retrieved: nobody else may be waiting
            if isinstance(exc, OSError | TimeoutError):
                raise failure from exc
            raise
        finally:
            self._connecting = None
        self._connection = connection
        connecting.set_result(connection)
        return connection

    async def _open(self, loop: asyncio.AbstractEventLoop) -> _Connection:
        address = self.address
        tls = self._ssl
        connection: _Connection
        if address.path is not None:
            _, connection = await loop.create_unix_connection(
                lambda: _Connection(loop), address.path
            )
        else:
            _, connection = await loop.create_connection(
                lambda: _Connection(loop), address.host, address.port, ssl=tls
            )
        try:
            for frame in address.setup():
                await connection.send(frame)
        except BaseException:
            connection.close()
            raise
        return connection
