"""The ``Store`` contract shared by the in-process and Redis backends."""

from __future__ import annotations

from enum import StrEnum
from typing import Protocol, runtime_checkable

import msgspec

from carryover.state.keys import ConversationKey
from carryover.state.records import Record

__all__ = ["FENCE_SLACK", "Committed", "Held", "Kept", "Oldest", "Store", "StoreUnavailable"]

#: Seconds a fenced commit's turn is taken to have started before its caller measured. The
#: caller measures the running time before the store reads its clock, and a pause between the
#: two (a GC, the network to Redis, a resend within the call's deadline) makes the turn look
#: younger than it is: without the slack a turn that started before a DELETE could store the
#: ended conversation again. Erring the other way costs little: a new conversation under the
#: same id, started within the slack of its DELETE, does not keep its first turn's record.
FENCE_SLACK = 0.5


class StoreUnavailable(Exception):
    """The store could not answer in time. Callers serve the turn cold; they never fail it."""


class Held(msgspec.Struct, frozen=True):
    """The live handles whose blocks one decode instance holds for stored records.

    Attributes:
        count: how many.
        oldest_created_at: when the oldest of those relief may take was written (``None``
            when there are none).
        expired: records of that instance found expired unclaimed since the last read (their
            handles were never used: D freed the blocks at its TTL). Each is reported once,
            whichever replica reads it.
        releasable: how many of them pressure relief may take: not shadowed
            (``Record.shadowed``), so releasing them frees their blocks.
    """

    count: int = 0
    oldest_created_at: float | None = None
    expired: int = 0
    releasable: int = 0


class Committed(msgspec.Struct, frozen=True):
    """What a commit did.

    Attributes:
        written: the record is stored (no record of a later turn was).
        replaced: the live record it overwrote, if any. Nobody claimed it, so its handle was
            never sent: the caller releases it, or D keeps those blocks for its whole TTL.
    """

    written: bool
    replaced: Record | None = None
    ended: bool = False  #: refused: the conversation was ended after this turn started
    #: a record was replaced but is not handed back: no replica acknowledged the write in
    #: time (Redis durability ``replica``), and a failover could bring that record back
    withheld: bool = False


class Oldest(msgspec.Struct, frozen=True):
    """What :meth:`Store.claim_oldest` took.

    Attributes:
        records: claimed, and only this caller holds them: release their handles.
        withheld: records claimed without a replica's acknowledgement (Redis durability
            ``replica``). A failover could bring them back, so their handles are neither
            used nor released (D frees them at its TTL); claiming stopped there.
    """

    records: list[Record]
    withheld: int = 0


class Kept(StrEnum):
    """What a store keeps in the router's own memory, by kind (each bounded: docs/operations.md)."""

    RECORDS = "records"  #: conversation records (in process only; Redis keeps its own)
    FENCES = "fences"  #: DELETE fences (in process only; in Redis a key each, with a TTL)
    DECODE_NAMES = "decode_names"  #: decode names the Redis store carries in each record script


class TenantUsage(msgspec.Struct, frozen=True):
    """What one tenant holds: live conversation records, and the tokens D pins for them."""

    conversations: int = 0
    pinned_tokens: int = 0


@runtime_checkable
class Store(Protocol):
    """Conversation records and decode-instance epochs.

    Every method either answers or raises :class:`StoreUnavailable` within the backend's timeout.
    """

    async def claim(self, key: ConversationKey) -> Record | None:
        """Take the record out of the store (get-and-delete in one step): a handle is used once."""
        ...

    async def commit(
        self,
        key: ConversationKey,
        record: Record,
        *,
        now: float,
        running_for: float | None = None,
    ) -> Committed:
        """Store ``record`` unless a record of a later turn is stored, or the conversation
        was ended (:meth:`delete` with a fence) after its turn started, ``running_for``
        seconds ago (:data:`FENCE_SLACK` earlier). The store places both on its own clock (a
        duration, not a time, crosses from the caller): replicas whose clocks differ fence
        the turns in flight;
        expire it at ``record.expires_at``. Says whether it was written and what live record
        it replaced."""
        ...

    async def get(self, key: ConversationKey) -> Record | None:
        """Read the record without taking it (inspection only: never send its handle)."""
        ...

    async def delete(self, key: ConversationKey, *, fence: float = 0.0) -> Record | None:
        """Drop the record; returns what was dropped. With a ``fence``, commits of turns
        that started before now (the store's clock) are refused for ``fence`` seconds: a
        turn in flight when its conversation was ended does not bring it back."""
        ...

    async def observe_identity(self, instance: str, identity: str) -> int:
        """Record which process a decode instance runs as (its process start time, as every
        replica scrapes it) and return its epoch. The epoch goes up once per new identity,
        however many replicas report it, so records of the old process are stale and records
        any replica wrote since are not. The first identity ever seen keeps the epoch."""
        ...

    async def epochs(self, instances: list[str]) -> dict[str, int]:
        """Current epochs of the named instances (0 for one never bumped)."""
        ...

    async def count(self) -> int:
        """How many live records the store holds (for operations and soak reports)."""
        ...

    async def held(self, instances: list[str], *, now: float) -> dict[str, Held]:
        """Live (unexpired, unclaimed) records by the decode instance holding their blocks."""
        ...

    async def usage_by_tenant(self, instances: list[str], *, now: float) -> dict[str, TenantUsage]:
        """Live records and the tokens decode instances pin for them, by tenant, over the
        records whose blocks ``instances`` hold (every record names its decode instance)."""
        ...

    async def claim_oldest(self, instance: str, count: int, *, now: float) -> Oldest:
        """Claim (as :meth:`claim` does: each at most once, fleet-wide) up to ``count`` of the
        live records whose blocks ``instance`` holds, the oldest of the tenant holding most
        of them first (``state/relief.py``): what the router gives
        back when that decode instance runs short of KV blocks."""
        ...

    async def set_draining(self, instance: str, draining: bool) -> None:
        """Mark ``instance`` as draining (no new requests) for every router, or clear it."""
        ...

    async def draining(self) -> set[str]:
        """The instances marked draining, fleet-wide."""
        ...

    async def take_turn(self, name: str, seconds: float, *, now: float) -> bool:
        """True for exactly one caller, fleet-wide, per ``seconds`` for ``name``: the one
        process (worker, replica) that runs a periodic job (pressure relief of one decode
        instance) this period."""
        ...

    def forget(self, instance: str) -> None:
        """``instance`` left the fleet and its records were given back: the store stops
        carrying what it learned of it for every call (a record that still names it is
        found as before, at the cost of a second round trip). Epochs are kept: a name that
        comes back must not reuse handles of the instance that had it."""

    def kept(self) -> dict[Kept, int]:
        """How many of each kind this process keeps now (read for ``carryover_store_kept``);
        kinds the backend does not keep in this process are absent."""
        ...

    async def ping(self) -> None:
        """Raise :class:`StoreUnavailable` if the store cannot answer."""
        ...

    async def close(self) -> None: ...
