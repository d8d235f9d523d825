"""A primary watched by Redis Sentinel: commands go to whichever server the Sentinels name.

The primary is asked of the Sentinels in turn (``SENTINEL GET-MASTER-ADDR-BY-NAME``) and
confirmed with ``ROLE`` before it is used: a Sentinel that has not caught up with a failover
can still name the old one. After any failure (a refused connect, ``READONLY`` from a demoted
primary, a call that ran out of time) the next command asks again, so a failover is followed
within one call; a command that certainly did not run is retried within the caller's
deadline (``state/channel.py``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

from carryover.state.channel import RETRY_PAUSE, Follow, refused_before_running
from carryover.state.resp import (
    Address,
    Arg,
    RespChannel,
    RespConnectionError,
    RespNotSent,
    RespTlsError,
    Script,
)

__all__ = ["SentinelChannel"]

T = TypeVar("T")


class SentinelChannel:
    """Args:
    template: the data nodes' credentials, database and TLS.
    sentinels: the Sentinels' hosts and ports.
    master_name: the name the Sentinels monitor the primary under.
    sentinel_password: the Sentinels' own password, if they have one.
    """

    def __init__(
        self,
        template: Address,
        sentinels: Sequence[tuple[str, int]],
        master_name: str,
        *,
        sentinel_password: str | None = None,
        connect_timeout: float = 1.0,
        dead_after: float = 1.0,
    ) -> None:
        if not sentinels:
            raise ValueError("a Sentinel URL names at least one Sentinel")
        self._template = template
        self._master_name = master_name
        self._connect_timeout = connect_timeout
        self._dead_after = dead_after
        # Sentinels speak TLS when the data nodes do, with the same CA and client certificate.
        sentinel_address = Address(
            password=sentinel_password, tls=template.tls, tls_files=template.tls_files
        )
        self._sentinels = [
            RespChannel(
                sentinel_address.at(host, port), connect_timeout=connect_timeout, dead_after=1.0
            )
            for host, port in sentinels
        ]
        self._primary: RespChannel | None = None
        self._suspect = True  # ask the Sentinels before the next command

    async def _find_primary(self) -> RespChannel:
        failures: list[str] = []
        for index, sentinel in enumerate(self._sentinels):
            try:
                reply = await sentinel.call(
                    "SENTINEL", "GET-MASTER-ADDR-BY-NAME", self._master_name
                )
            except RespTlsError:
                raise
            except RespConnectionError as exc:
                failures.append(f"{sentinel.address!r}: {exc}")
                continue
            if reply is None:
                failures.append(f"{sentinel.address!r} does not know {self._master_name!r}")
                continue
            host, port = reply[0].decode(), int(reply[1])
            current = self._primary
            if current is not None and (current.address.host, current.address.port) == (
                host,
                port,
            ):
                candidate = current
            else:
                candidate = RespChannel(
                    self._template.at(host, port),
                    connect_timeout=self._connect_timeout,
                    dead_after=self._dead_after,
                )
            try:
                role = await candidate.call("ROLE")
            except RespTlsError:
                raise
            except RespConnectionError as exc:
                failures.append(f"primary {host}:{port}: {exc}")
                continue
            if role[0] != b"master":
                failures.append(f"{host}:{port} is a {role[0].decode()}")
                continue
            if candidate is not current and current is not None:
                current.close()
            # The Sentinel that answered first is asked first next time.
            self._sentinels.insert(0, self._sentinels.pop(index))
            self._primary = candidate
            self._suspect = False
            return candidate
        raise RespNotSent("no Sentinel named a reachable primary: " + "; ".join(failures))

    async def _on_primary(self, send: Callable[[RespChannel], Awaitable[T]]) -> T:
        while True:
            primary = self._primary
            try:
                if primary is None or self._suspect:
                    primary = await self._find_primary()
                return await send(primary)
            except BaseException as exc:
                self._suspect = True
                if not refused_before_running(exc):
                    raise
            await asyncio.sleep(RETRY_PAUSE)

    async def call(self, *args: Arg) -> Any:
        return await self._on_primary(lambda channel: channel.call(*args))

    async def script(
        self, script: Script, keys: Sequence[Arg], args: Sequence[Arg], *, after: Follow = None
    ) -> tuple[Any, Any]:
        return await self._on_primary(
            lambda channel: channel.script(script, keys, args, after=after)
        )

    async def primaries(self) -> list[RespChannel]:
        async def found(channel: RespChannel) -> RespChannel:
            return channel

        return [await self._on_primary(found)]

    def close(self) -> None:
        for channel in [*self._sentinels, *filter(None, [self._primary])]:
            channel.close()
