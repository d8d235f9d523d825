"""A store on real Redis learns each decode instance that holds a record: every record script
carries their indexes. One that left the fleet and holds nothing is forgotten, so that DNS
churn does not grow the cost of every commit and claim; a record that still names it is found
and kept in step as before."""

from __future__ import annotations

import time
import uuid

from carryover.bench.redis_server import RedisServer
from carryover.state import ConversationKey, Kept, RedisStore
from tests.support.records import make_record


def _key(n: int) -> ConversationKey:
    return ConversationKey("acme", "m", f"c{n}")


async def test_departed_instances_are_forgotten_and_a_record_naming_one_still_kept_in_step(
    redis_server: RedisServer,
) -> None:
    store = RedisStore.from_url(
        str(redis_server.url), namespace=f"t{uuid.uuid4().hex}", timeout=2.0
    )
    try:
        for n in range(50):
            record = make_record(1, decode=f"d{n}")
            assert (await store.commit(_key(n), record, now=time.time())).written
        assert len(store.known) == 50 and store.kept() == {Kept.DECODE_NAMES: 50}
        for n in range(1, 49):  # these left; their records were given back
            assert await store.claim(_key(n)) is not None
            store.forget(f"d{n}")
        store.forget("d0")  # left, but its record is still stored
        assert store.known == ["d49"] and store.kept() == {Kept.DECODE_NAMES: 1}
        # The record naming d0 is claimed and taken out of d0's index all the same.
        assert (await store.held(["d0"], now=time.time()))["d0"].count == 1
        assert await store.claim(_key(0)) is not None
        assert (await store.held(["d0"], now=time.time()))["d0"].count == 0
        assert sorted(store.known) == ["d0", "d49"]  # learned again, while it was needed
        # Commits on the live instance carry its indexes only.
        assert (await store.commit(_key(49), make_record(2, decode="d49"), now=time.time())).written
        assert (await store.held(["d49"], now=time.time()))["d49"].count == 1
    finally:
        await store.close()
