"""A Redis Cluster: every command to the primary serving its key's slot.

The slot map comes from ``CLUSTER SLOTS`` of any node the channel knows (the URL's seeds,
then every node a map named), and is read again after a redirect or a failure. A ``MOVED``
reply (the slot lives elsewhere now) updates the slot's owner and sends the command there;
``ASK`` (the slot is being migrated and this key already moved) sends ``ASKING`` and the
command to the target once, without changing the map. Each node gets one pipelined
:class:`~state.resp.RespChannel`.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

from carryover.state.channel import RETRY_PAUSE, Follow, refused_before_running
from carryover.state.resp import (
    Address,
    Arg,
    ReplyError,
    RespChannel,
    RespConnectionError,
    RespTlsError,
    Script,
)
from carryover.state.slots import SLOTS, key_slot

__all__ = ["ClusterChannel"]

T = TypeVar("T")
Node = tuple[str, int]


def _node(reply: str) -> Node:
    host, _, port = reply.rpartition(":")
    return host, int(port)


class ClusterChannel:
    """Args:
    template: credentials and TLS every node's connection uses.
    seeds: nodes to read the first slot map from.
    connect_timeout, dead_after: as :class:`~state.resp.RespChannel`'s, per node.
    """

    def __init__(
        self,
        template: Address,
        seeds: Sequence[Node],
        *,
        connect_timeout: float = 1.0,
        dead_after: float = 1.0,
    ) -> None:
        if not seeds:
            raise ValueError("a Redis Cluster URL names at least one node")
        self._template = template
        self._seeds = list(seeds)
        self._connect_timeout = connect_timeout
        self._dead_after = dead_after
        self._nodes: dict[Node, RespChannel] = {}
        self._owner: list[Node | None] = [None] * SLOTS
        self._stale = True
        self._refreshing: asyncio.Task[None] | None = None

    def _channel(self, node: Node) -> RespChannel:
        channel = self._nodes.get(node)
        if channel is None:
            channel = self._nodes[node] = RespChannel(
                self._template.at(*node),
                connect_timeout=self._connect_timeout,
                dead_after=self._dead_after,
            )
        return channel

    async def _refresh(self) -> None:
        # One refresh at a time; callers that need one meanwhile wait for it.
        task = self._refreshing
        if task is None or task.done() or task.get_loop() is not asyncio.get_running_loop():
            task = self._refreshing = asyncio.ensure_future(self._read_map())
        await asyncio.shield(task)

    async def _read_map(self) -> None:
        failures: list[str] = []
        for node in [*self._seeds, *(n for n in self._nodes if n not in self._seeds)]:
            try:
                # Each node gets a connect timeout: a frozen one must not hold up the rest.
                async with asyncio.timeout(self._connect_timeout):
                    reply = await self._channel(node).call("CLUSTER", "SLOTS")
            except RespTlsError:
                raise
            except TimeoutError:
                failures.append(f"{node[0]}:{node[1]}: no answer")
                continue
            except RespConnectionError as exc:
                failures.append(f"{node[0]}:{node[1]}: {exc}")
                continue
            owner: list[Node | None] = [None] * SLOTS
            for start, end, primary, *_replicas in reply:
                host = primary[0].decode() or node[0]  # "" : the node asked
                where = (host, int(primary[1]))
                owner[start : end + 1] = [where] * (end - start + 1)
            self._owner = owner
            self._stale = False
            return
        raise RespConnectionError("no Redis Cluster node answered: " + "; ".join(failures))

    async def _routed(self, key: Arg, send: Callable[[RespChannel, bool], Awaitable[T]]) -> T:
        slot = key_slot(key if isinstance(key, bytes | str) else str(key))
        asking: Node | None = None
        while True:
            if self._stale:
                try:
                    await self._refresh()
                except RespTlsError:
                    raise
                except RespConnectionError:
                    await asyncio.sleep(RETRY_PAUSE)
                    continue
            target = asking or self._owner[slot]
            if target is None:  # a slot no primary serves: the cluster is not ready
                self._stale = True
                await asyncio.sleep(RETRY_PAUSE)
                continue
            try:
                return await send(self._channel(target), asking is not None)
            except ReplyError as exc:
                text = str(exc)
                if text.startswith("MOVED"):
                    self._owner[slot] = _node(text.split()[2])
                    self._stale = True  # more than one slot moved, most likely
                    asking = None
                    continue
                if text.startswith("ASK"):
                    asking = _node(text.split()[2])
                    continue
                if not refused_before_running(exc):
                    raise
            except RespConnectionError as exc:
                if not refused_before_running(exc):
                    self._stale = True  # the node may be gone: read the map next time
                    raise
            except asyncio.CancelledError:
                # Out of time (the store's deadline): the node may be frozen, its slots
                # already served by a promoted replica. Read the map before the next call.
                self._stale = True
                raise
            asking = None
            self._stale = True
            await asyncio.sleep(RETRY_PAUSE)

    async def call(self, *args: Arg) -> Any:
        async def send(channel: RespChannel, asking: bool) -> Any:
            if not asking:
                return await channel.call(*args)
            reply = (await channel.run(["ASKING"], args))[1]
            if isinstance(reply, BaseException):
                raise reply
            return reply

        return await self._routed(args[1] if len(args) > 1 else "", send)

    async def script(
        self, script: Script, keys: Sequence[Arg], args: Sequence[Arg], *, after: Follow = None
    ) -> tuple[Any, Any]:
        async def send(channel: RespChannel, asking: bool) -> tuple[Any, Any]:
            before = ["ASKING"] if asking else None
            return await channel.script(script, keys, args, before=before, after=after)

        return await self._routed(keys[0] if keys else "", send)

    async def primaries(self) -> list[RespChannel]:
        if self._stale:
            await self._refresh()
        return [self._channel(node) for node in dict.fromkeys(self._owner) if node is not None]

    def close(self) -> None:
        if self._refreshing is not None:
            self._refreshing.cancel()
            with contextlib.suppress(BaseException):
                self._refreshing.exception()
        for channel in self._nodes.values():
            channel.close()
