"""In-process store: the embedded default for a single router.

Atomicity comes from asyncio itself: no method awaits between reading and writing.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from carryover.state.keys import ConversationKey
from carryover.state.records import Record
from carryover.state.relief import largest_holders_first
from carryover.state.store import FENCE_SLACK, Committed, Held, Kept, Oldest, TenantUsage

__all__ = ["MemoryStore"]

_SWEEP_EVERY = 1024
#: Fences of ended conversations kept at most (DELETE of ids never stored makes them too):
#: beyond it the oldest goes first, a turn of it that still runs may then store it again.
FENCE_LIMIT = 100_000


class MemoryStore:
    """Records in a dict, expired lazily on access and swept every 1,024 commits."""

    def __init__(
        self, *, clock: Callable[[], float] = time.time, fence_limit: int = FENCE_LIMIT
    ) -> None:
        self._clock = clock
        self._fence_limit = fence_limit
        self.fences_evicted = 0  #: fences dropped at the limit before their time
        self._records: dict[ConversationKey, Record] = {}
        self._epochs: dict[str, int] = {}
        self._identities: dict[str, str] = {}
        # (ended at, until), oldest first: each lasts as long, so they end in this order.
        self._ended: dict[ConversationKey, tuple[float, float]] = {}
        self._commits = 0
        self._expired: dict[str, int] = {}  # by decode instance, since the last held()
        self._turns: dict[str, float] = {}  # take_turn: until when each name is taken
        self._draining: set[str] = set()

    def _live(self, key: ConversationKey) -> Record | None:
        record = self._records.get(key)
        if record is not None and record.expired(self._clock()):
            self._drop_expired(key, record)
            return None
        return record

    def _drop_expired(self, key: ConversationKey, record: Record) -> None:
        del self._records[key]
        self._expired[record.decode] = self._expired.get(record.decode, 0) + 1

    async def claim(self, key: ConversationKey) -> Record | None:
        record = self._live(key)
        if record is not None:
            del self._records[key]
        return record

    async def commit(
        self,
        key: ConversationKey,
        record: Record,
        *,
        now: float,
        running_for: float | None = None,
    ) -> Committed:
        if record.expired(now):
            return Committed(written=False)
        ended = self._ended.get(key)
        clock = self._clock()  # the store's own: callers' clocks may differ
        if ended is not None and ended[1] <= clock:
            del self._ended[key]
        elif (
            ended is not None
            and running_for is not None
            and clock - running_for - FENCE_SLACK <= ended[0]
        ):
            return Committed(written=False, ended=True)
        current = self._live(key)
        if current is not None and current.turn > record.turn:
            return Committed(written=False)
        self._records[key] = record
        self._commits += 1
        if self._commits % _SWEEP_EVERY == 0:
            self._sweep()
        return Committed(written=True, replaced=current)

    def _sweep(self) -> None:
        now = self._clock()
        for key, record in [(k, r) for k, r in self._records.items() if r.expired(now)]:
            self._drop_expired(key, record)
        # Fences of ended conversations nobody came back to, from the oldest: the sweep
        # stops at the first that still holds, whatever their number.
        while self._ended:
            key, (_, until) = next(iter(self._ended.items()))
            if until > now:
                break
            del self._ended[key]

    async def get(self, key: ConversationKey) -> Record | None:
        return self._live(key)

    async def delete(self, key: ConversationKey, *, fence: float = 0.0) -> Record | None:
        record = self._live(key)
        self._records.pop(key, None)
        if fence > 0:
            now = self._clock()
            self._ended.pop(key, None)  # a new fence goes last, in its order of ending
            self._ended[key] = (now, now + fence)
            if len(self._ended) > self._fence_limit:
                del self._ended[next(iter(self._ended))]
                self.fences_evicted += 1
        return record

    async def observe_identity(self, instance: str, identity: str) -> int:
        seen = self._identities.get(instance)
        self._identities[instance] = identity
        if seen is not None and seen != identity:
            self._epochs[instance] = self._epochs.get(instance, 0) + 1
        return self._epochs.get(instance, 0)

    async def epochs(self, instances: list[str]) -> dict[str, int]:
        return {name: self._epochs.get(name, 0) for name in instances}

    async def count(self) -> int:
        self._sweep()
        return len(self._records)

    async def held(self, instances: list[str], *, now: float) -> dict[str, Held]:
        self._sweep()
        expired = {name: self._expired.pop(name, 0) for name in instances}
        counts = dict.fromkeys(instances, 0)
        releasable = dict.fromkeys(instances, 0)
        oldest: dict[str, float] = {}
        for record in self._records.values():
            if record.decode not in counts or record.expired(now):
                continue
            counts[record.decode] += 1
            if record.shadowed:
                continue
            releasable[record.decode] += 1
            oldest[record.decode] = min(
                oldest.get(record.decode, record.created_at), record.created_at
            )
        return {
            name: Held(counts[name], oldest.get(name), expired[name], releasable[name])
            for name in instances
        }

    async def usage_by_tenant(self, instances: list[str], *, now: float) -> dict[str, TenantUsage]:
        wanted = set(instances)
        found: dict[str, tuple[int, int]] = {}
        for key, record in self._records.items():
            if record.decode in wanted and not record.expired(now):
                count, tokens = found.get(key.tenant, (0, 0))
                found[key.tenant] = (count + 1, tokens + record.prefix.length)
        return {tenant: TenantUsage(*usage) for tenant, usage in found.items()}

    async def claim_oldest(self, instance: str, count: int, *, now: float) -> Oldest:
        held = [
            (record.created_at, key, key.tenant)
            for key, record in self._records.items()
            if record.decode == instance and not record.expired(now) and not record.shadowed
        ]
        return Oldest([self._records.pop(key) for key in largest_holders_first(held, count)])

    async def set_draining(self, instance: str, draining: bool) -> None:
        if draining:
            self._draining.add(instance)
        else:
            self._draining.discard(instance)

    async def draining(self) -> set[str]:
        return set(self._draining)

    def forget(self, instance: str) -> None:
        self._expired.pop(instance, None)

    def kept(self) -> dict[Kept, int]:
        return {Kept.RECORDS: len(self._records), Kept.FENCES: len(self._ended)}

    async def take_turn(self, name: str, seconds: float, *, now: float) -> bool:
        if self._turns.get(name, 0.0) > now:
            return False
        self._turns[name] = now + seconds
        return True

    async def ping(self) -> None:
        return None

    async def close(self) -> None:
        return None
