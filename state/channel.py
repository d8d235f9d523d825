"""What the Redis store sends its commands over, whatever the deployment.

One server is a :class:`~state.resp.RespChannel`; a Sentinel-watched primary and a Cluster
wrap one channel per data node (``state/sentinel.py``, ``state/cluster.py``). All of them
retry a command only when it certainly did not run: it was never sent (no connection), or
the server refused it before running it (``READONLY`` from a demoted primary, ``LOADING``,
``MASTERDOWN``, ``TRYAGAIN``, ``CLUSTERDOWN``, ``MOVED``, ``ASK``). A command that was sent
and then lost its connection may have run: it fails, and the store serves the turn cold. The
retries run inside the caller's deadline (the store's call timeout), with a short pause
between them while a new primary is elected.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from carryover.state.resp import Arg, ReplyError, RespChannel, RespNotSent, Script

__all__ = ["RETRY_PAUSE", "Channel", "Follow", "refused_before_running"]

Follow = Sequence[Arg] | None  #: a command written right behind another on its connection

RETRY_PAUSE = 0.05  #: seconds between retries of a command that did not run

_NOT_RUN = ("READONLY", "LOADING", "MASTERDOWN", "TRYAGAIN", "CLUSTERDOWN")


def refused_before_running(exc: BaseException) -> bool:
    """The command did not run: sending it again cannot run it twice."""
    if isinstance(exc, RespNotSent):
        return True
    return isinstance(exc, ReplyError) and str(exc).startswith(_NOT_RUN)


class Channel(Protocol):
    """Commands of the store. A command's keys all share one Cluster slot; a Cluster routes
    it by its first key (``call``: the argument after the command name)."""

    async def call(self, *args: Arg) -> Any: ...

    async def script(
        self, script: Script, keys: Sequence[Arg], args: Sequence[Arg], *, after: Follow = None
    ) -> tuple[Any, Any]:
        """The script with ``after`` (``WAIT``) written right behind it on the same node."""
        ...

    async def primaries(self) -> list[RespChannel]:
        """A channel to each primary (to scan every node's keys)."""
        ...

    def close(self) -> None: ...
