"""One contract, every backend: the in-process store, and real Redis as one server, as a
primary and replica behind three Sentinels, and as a 3-primary/3-replica Cluster."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator

import msgspec
import pytest

from carryover.bench.redis_server import RedisServer
from carryover.state import (
    FENCE_SLACK,
    Committed,
    ConversationKey,
    Held,
    MemoryStore,
    RedisStore,
    Store,
    TenantUsage,
)
from tests.support.records import make_record
from tests.support.waiting import eventually

TOPOLOGIES = ["single", "sentinel", "cluster"]


@pytest.fixture(params=["memory", *TOPOLOGIES])
async def store(request: pytest.FixtureRequest) -> AsyncIterator[Store]:
    backend: Store
    if request.param == "memory":
        backend = MemoryStore()
    else:
        url = _url(request, request.param)
        # A generous deadline: this is the contract, not the speed (first calls load scripts
        # and open connections, slow on a loaded machine).
        backend = RedisStore.from_url(url, namespace=f"t{uuid.uuid4().hex}", timeout=2.0)
    yield backend
    await backend.close()


def _url(request: pytest.FixtureRequest, topology: str) -> str:
    fixture = {"single": "redis_server", "sentinel": "redis_sentinels", "cluster": "redis_cluster"}
    return str(request.getfixturevalue(fixture[topology]).url)


def key(name: str = "c1", tenant: str = "acme") -> ConversationKey:
    return ConversationKey(tenant, "m", name)


async def test_claim_is_single_use(store: Store) -> None:
    assert await store.claim(key()) is None
    record = make_record(1)
    assert (await store.commit(key(), record, now=time.time())).written
    assert await store.get(key()) == record  # inspection does not take it
    assert await store.claim(key()) == record
    assert await store.claim(key()) is None


async def test_a_commit_says_what_it_replaced(store: Store) -> None:
    first, second, third = make_record(4), make_record(4), make_record(5)
    assert await store.commit(key(), first, now=time.time()) == Committed(True, None)
    # Same turn (a client retry, two requests in flight): the unclaimed one comes back.
    assert await store.commit(key(), second, now=time.time()) == Committed(True, first)
    assert await store.commit(key(), third, now=time.time()) == Committed(True, second)
    assert await store.commit(key(), make_record(3), now=time.time()) == Committed(False, None)
    assert await store.claim(key()) == third
    assert await store.commit(key(), make_record(6), now=time.time()) == Committed(True, None)


async def test_an_ended_conversation_refuses_turns_that_started_before(store: Store) -> None:
    began = time.monotonic()
    assert (await store.commit(key(), make_record(1), now=time.time())).written
    assert await store.delete(key(), fence=60) is not None
    deleted = time.monotonic()
    # A turn in flight when DELETE came does not bring the conversation back...
    running = time.monotonic() - began
    late = await store.commit(key(), make_record(2), now=time.time(), running_for=running)
    assert late == Committed(False, None, ended=True)
    assert await store.get(key()) is None
    # ...a turn that started after it does (the id may start a new conversation), once past
    # the store's slack. Only a duration crosses to the store, which places both on its clock.
    await eventually(
        _now, lambda now: now - deleted > FENCE_SLACK, what="the clock moves past the slack"
    )
    started = time.monotonic()
    running = time.monotonic() - started
    new = await store.commit(key(), make_record(1), now=time.time(), running_for=running)
    assert new.written and not new.ended
    # Without a fence, DELETE only drops.
    assert await store.delete(key("c2")) is None
    assert (await store.commit(key("c2"), make_record(1), now=time.time(), running_for=1e6)).written


async def test_a_pause_between_measuring_a_turn_and_committing_it_does_not_unfence_it(
    store: Store,
) -> None:
    # The caller measures how long its turn has run, then pauses (a GC, the network to Redis,
    # a resend) before the store reads its clock: the turn looks younger than it is. A turn
    # that started before the DELETE must still be refused.
    began = time.monotonic()
    assert (await store.commit(key(), make_record(1), now=time.time())).written
    assert await store.delete(key(), fence=60) is not None
    running = time.monotonic() - began
    measured = time.monotonic()
    await eventually(_now, lambda now: now - measured > 0.05, what="a 50 ms pause")
    late = await store.commit(key(), make_record(2), now=time.time(), running_for=running)
    assert late == Committed(False, None, ended=True)
    assert await store.get(key()) is None


async def _now() -> float:
    return time.monotonic()


async def test_later_turn_wins_and_earlier_is_refused(store: Store) -> None:
    assert (await store.commit(key(), make_record(4), now=time.time())).written
    assert not (await store.commit(key(), make_record(3), now=time.time())).written
    got = await store.get(key())
    assert got is not None and got.turn == 4
    assert (await store.commit(key(), make_record(5), now=time.time())).written
    got = await store.get(key())
    assert got is not None and got.turn == 5


async def test_expiry_is_honoured(store: Store) -> None:
    # Redis expires a record by its own clock, which no test can move: a short lifetime, and
    # its end waited for as a condition. Read before then, the record is there.
    written_at = time.monotonic()
    assert (await store.commit(key(), make_record(1, ttl=0.3), now=time.time())).written
    assert await store.get(key()) is not None or time.monotonic() - written_at >= 0.3
    await eventually(lambda: store.get(key()), lambda r: r is None, what="the record expiring")
    assert await store.claim(key()) is None
    # An already expired record is not written at all.
    assert not (await store.commit(key(), make_record(2, ttl=-1), now=time.time())).written


async def test_fifty_claimers_get_the_record_exactly_once(store: Store) -> None:
    await store.commit(key(), make_record(7), now=time.time())
    results = await asyncio.gather(*(store.claim(key()) for _ in range(50)))
    winners = [r for r in results if r is not None]
    assert len(winners) == 1 and winners[0].turn == 7


async def test_tenants_and_conversations_are_apart(store: Store) -> None:
    await store.commit(key("c1", "a"), make_record(1), now=time.time())
    assert await store.claim(key("c1", "b")) is None
    assert await store.claim(key("c2", "a")) is None
    assert await store.claim(key("c1", "a")) is not None


async def test_delete_and_count(store: Store) -> None:
    base = await store.count()
    for i in range(3):
        await store.commit(key(f"c{i}"), make_record(1), now=time.time())
    assert await store.count() == base + 3
    dropped = await store.delete(key("c1"))
    assert dropped is not None and dropped.turn == 1
    assert await store.delete(key("c1")) is None
    assert await store.count() == base + 2


async def test_epochs(store: Store) -> None:
    name = f"d-{uuid.uuid4().hex}"
    assert await store.epochs([name]) == {name: 0}
    assert await store.observe_identity(name, "started-1") == 0  # first seen: no restart
    assert await store.observe_identity(name, "started-1") == 0
    assert await store.observe_identity(name, "started-2") == 1
    # Every replica reports the same restart: one bump, not one per replica.
    assert await store.observe_identity(name, "started-2") == 1
    assert await store.observe_identity(name, "started-3") == 2
    assert await store.epochs([name, "other-" + name]) == {name: 2, "other-" + name: 0}
    assert await store.epochs([]) == {}


@pytest.fixture(params=TOPOLOGIES)
async def replicas(request: pytest.FixtureRequest) -> AsyncIterator[tuple[RedisStore, RedisStore]]:
    """Two routers' stores on one Redis namespace."""
    namespace = f"t{uuid.uuid4().hex}"
    url = _url(request, request.param)
    a = RedisStore.from_url(url, namespace=namespace, timeout=2.0)
    b = RedisStore.from_url(url, namespace=namespace, timeout=2.0)
    yield a, b
    await a.close()
    await b.close()


async def test_two_routers_racing_commits_end_with_the_later_turn(
    replicas: tuple[RedisStore, RedisStore],
) -> None:
    a, b = replicas
    for round_ in range(20):
        k = key(f"race{round_}")
        first, second = (a, b) if round_ % 2 else (b, a)
        await asyncio.gather(
            first.commit(k, make_record(4), now=time.time()),
            second.commit(k, make_record(3), now=time.time()),
        )
        got = await a.get(k)
        assert got is not None and got.turn == 4


async def test_held_handles_follow_commits_claims_overwrites_and_expiry(store: Store) -> None:
    # c2 lives two seconds (far more than the next reads take) and its end is waited for as a
    # condition: Redis expires it by its own clock, which no test can move.
    names = ["d0", "d1", "never-used"]
    first = make_record(1, decode="d0")
    await store.commit(key("c1"), first, now=time.time())
    short = make_record(1, decode="d0", ttl=2)
    await store.commit(key("c2"), short, now=time.time())
    await store.commit(key("c3"), make_record(1, decode="d1"), now=time.time())
    held = await store.held(names, now=time.time())
    assert (held["d0"].count, held["d1"].count, held["never-used"].count) == (2, 1, 0)
    assert held["d0"].oldest_created_at == pytest.approx(first.created_at, abs=1e-3)
    assert held["never-used"].oldest_created_at is None

    # A later turn of c3 is held by d0 now: d1 no longer holds anything for it.
    await store.commit(key("c3"), make_record(2, decode="d0"), now=time.time())
    held = await store.held(names, now=time.time())
    assert (held["d0"].count, held["d1"].count) == (3, 0)

    # A claimed record is no longer held; neither is an expired one.
    assert await store.claim(key("c1")) is not None
    await eventually(lambda: store.get(key("c2")), lambda r: r is None, what="c2 expiring")
    # Redis may drop the key up to a millisecond before its expiry time (whole milliseconds):
    # the index is read at that time or later, as any read after it would be.
    held = await store.held(names, now=max(time.time(), short.expires_at))
    assert held["d0"].count == 1
    assert held["d0"].oldest_created_at is not None
    assert held["d0"].oldest_created_at > first.created_at
    assert await store.delete(key("c3")) is not None
    # c2 expired unclaimed: counted once, by whichever read came first.
    reads = [held["d0"].expired, (await store.held(names, now=time.time()))["d0"].expired]
    assert sum(reads) == 1
    assert (await store.held(names, now=time.time()))["d0"] == Held(0, None, 0)


async def test_a_record_that_expired_unclaimed_is_counted_even_when_its_turn_resumes(
    store: Store,
) -> None:
    # The conversation goes on after its record expired: the new record takes the old one's
    # place, and the unused handle is still counted, on the instance that held it.
    # The records must be gone from Redis, which expires them by its own clock: a short
    # lifetime, its end waited for as a condition.
    await store.commit(key("r1"), make_record(1, decode="d0", ttl=0.2), now=time.time())
    await store.commit(key("r2"), make_record(1, decode="d1", ttl=0.2), now=time.time())
    for name in ("r1", "r2"):
        await eventually(
            lambda name=name: store.get(key(name)), lambda r: r is None, what=f"{name} expiring"
        )
    await store.commit(key("r1"), make_record(2, decode="d0"), now=time.time())
    await store.commit(key("r2"), make_record(2, decode="d0"), now=time.time())
    held = await store.held(["d0", "d1"], now=time.time())
    assert (held["d0"].count, held["d0"].expired) == (2, 1)
    assert (held["d1"].count, held["d1"].expired) == (0, 1)


async def test_a_burst_of_turns_pipelines_and_each_gets_its_own_reply(
    redis_server: RedisServer,
) -> None:
    # 200 concurrent turns share one pipelined connection: none is served cold, and the
    # replies, matched to callers in order, each carry the caller's own record.
    store = RedisStore.from_url(redis_server.url, namespace=f"t{uuid.uuid4().hex}", timeout=5)
    try:
        keys = [key(f"burst{i}") for i in range(200)]
        written = await asyncio.gather(
            *(store.commit(k, make_record(i + 1), now=time.time()) for i, k in enumerate(keys))
        )
        assert all(w.written for w in written)
        claimed = await asyncio.gather(*(store.claim(k) for k in keys))
        assert [r.turn if r else None for r in claimed] == list(range(1, 201))
    finally:
        await store.close()


async def test_claim_oldest_takes_the_oldest_live_records_of_one_instance_once(
    store: Store,
) -> None:
    now = time.time()
    for i in range(6):  # c0 oldest ... c5 newest on d0; one on d1; one about to expire
        record = msgspec.structs.replace(make_record(i + 1, decode="d0"), created_at=now - 60 + i)
        await store.commit(key(f"c{i}"), record, now=now)
    await store.commit(key("other"), make_record(1, decode="d1"), now=now)
    await store.commit(key("gone"), make_record(1, decode="d0", ttl=0.2), now=now)
    await eventually(
        lambda: store.get(key("gone")), lambda r: r is None, what="the short-lived record expiring"
    )

    first = (await store.claim_oldest("d0", 2, now=time.time())).records
    assert [r.turn for r in first] == [1, 2]
    # claimed as claim() does: gone for everyone, no longer counted as held
    assert await store.claim(key("c0")) is None
    second = await store.claim_oldest("d0", 10, now=time.time())
    assert [r.turn for r in second.records] == [3, 4, 5, 6] and second.withheld == 0
    assert (await store.claim_oldest("d0", 10, now=time.time())).records == []
    held = await store.held(["d0", "d1"], now=time.time())
    assert (held["d0"].count, held["d1"].count) == (0, 1)
    assert held["d0"].expired == 1  # the expired one is still counted, once
    assert await store.claim(key("other")) is not None


async def test_relief_takes_the_largest_holders_oldest_first(store: Store) -> None:
    """One tenant holding most of an instance's handles gives its own back first, even
    though another tenant's are older; among equal holders, the oldest goes first."""
    now = time.time()
    for i in range(2):  # the small tenant's two, the oldest of all
        record = msgspec.structs.replace(make_record(1, decode="d3"), created_at=now - 100 + i)
        await store.commit(key(f"small-{i}", tenant="small"), record, now=now)
    for i in range(5):
        record = msgspec.structs.replace(make_record(1, decode="d3"), created_at=now - 50 + i)
        await store.commit(key(f"big-{i}", tenant="big"), record, now=now)
    taken = (await store.claim_oldest("d3", 3, now=now)).records
    assert sorted(r.created_at for r in taken) == [now - 50, now - 49, now - 48]
    # 2 and 2 left: the oldest of the tied holders next (the small tenant's first).
    taken = (await store.claim_oldest("d3", 2, now=now)).records
    assert sorted(r.created_at for r in taken) == [now - 100, now - 47]


async def test_what_each_tenant_holds_is_counted(store: Store) -> None:
    now = time.time()
    for tenant, names in (("acme", ["c1", "c2", "c3"]), ("odd:te%3Ant", ["c1"])):
        for name in names:
            await store.commit(key(name, tenant=tenant), make_record(1, decode="d4"), now=now)
    await store.commit(key("c9", tenant="acme"), make_record(1, decode="d5"), now=now)
    await store.commit(key("gone", tenant="acme"), make_record(1, decode="d4", ttl=0.2), now=now)
    await eventually(
        lambda: store.get(key("gone", tenant="acme")), lambda r: r is None, what="an expiry"
    )
    assert await store.claim(key("c3")) is not None  # claimed: no longer live
    usage = await store.usage_by_tenant(["d4", "d5"], now=time.time())
    pinned = make_record(1).prefix.length
    assert usage == {
        "acme": TenantUsage(3, 3 * pinned),
        "odd:te%3Ant": TenantUsage(1, pinned),
    }
    # What relief or a later turn replaces leaves the counts too.
    await store.commit(key("c1"), make_record(2, decode="d5"), now=time.time())
    await store.claim_oldest("d5", 10, now=time.time())
    usage = await store.usage_by_tenant(["d4", "d5"], now=time.time())
    assert usage["acme"] == TenantUsage(1, pinned)


async def test_two_replicas_relieving_one_instance_never_take_a_record_twice(
    replicas: tuple[RedisStore, RedisStore],
) -> None:
    a, b = replicas
    for i in range(40):
        await a.commit(key(f"c{i}"), make_record(i + 1, decode="d0"), now=time.time())
    taken = await asyncio.gather(
        *(s.claim_oldest("d0", 7, now=time.time()) for s in (a, b, a, b, a, b, a))
    )
    turns = [r.turn for batch in taken for r in batch.records]
    assert sorted(turns) == list(range(1, 41))


async def test_shadowed_records_are_held_but_never_taken_by_relief(store: Store) -> None:
    now = time.time()
    for i, shadowed in enumerate((True, False, True)):  # c0 oldest, shadowed
        record = msgspec.structs.replace(
            make_record(1, decode="d9"), created_at=now - 60 + i, shadowed=shadowed
        )
        await store.commit(key(f"shadow-{i}"), record, now=now)
    held = (await store.held(["d9"], now=now))["d9"]
    assert (held.count, held.releasable) == (3, 1)
    assert held.oldest_created_at == now - 59  # the oldest relief may take
    oldest = await store.claim_oldest("d9", 10, now=now)
    assert [r.shadowed for r in oldest.records] == [False]
    # A turn claims a shadowed record as any other, and a later turn's record replaces it.
    assert (await store.claim(key("shadow-0"))) is not None
    await store.commit(key("shadow-2"), make_record(2, decode="d9"), now=now)
    held = (await store.held(["d9"], now=now))["d9"]
    assert (held.count, held.releasable) == (1, 1)


async def test_one_caller_per_period_takes_a_turn_fleet_wide(store: Store) -> None:
    now = time.time()
    other = f"relieve:{uuid.uuid4().hex}"
    name = f"relieve:{uuid.uuid4().hex}"
    assert await store.take_turn(name, 0.3, now=now)
    assert not await store.take_turn(name, 0.3, now=now)
    assert await store.take_turn(other, 0.3, now=now)  # each name its own turn
    await eventually(
        lambda: store.take_turn(name, 0.3, now=time.time()),
        bool,
        what="the next period's turn",
    )
