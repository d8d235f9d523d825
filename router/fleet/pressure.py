"""Giving back a decode instance's handles when its KV cache runs full: the oldest of the
tenant holding most of them first.

D pins every finished turn's blocks for ``decoder_kv_blocks_ttl`` and cannot evict them; its
``vllm:kv_cache_usage_perc`` counts them. Once pins fill the cache, running requests wait for
blocks until some pin's TTL runs out: with 1,000 live conversations a soak saw turns stall for
up to 35 s behind a full D. So when a D's usage reaches ``high_water``, the router claims the
handles stored for it, the oldest of the tenant that holds most of them first (state/relief.py:
no tenant can push another's history off D by holding more; within a tenant, the
conversations least likely to come back soon) and releases
them through P, as a DELETE does, until what it expects to free brings usage to ``low_water``.
A released conversation's next turn is cold; nothing is ever sent twice (claims are atomic,
also between replicas). While a D is at or above ``decode_kv_pin_limit`` (by default the same
mark), or has less room left than the finished turn's own size, turns ending there keep no pin
either (``keeps_new_pins``): relief frees what is held, not what keeps arriving. Every worker
of every replica probes the same usage, so each decode
instance is relieved by one process per interval, fleet-wide (``Store.take_turn``): N
processes give back what one would.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Awaitable, Callable, Iterable

from carryover.router.fleet.instance import Instance
from carryover.router.handles.fates import Event
from carryover.router.handles.ledger import HandleLedger, Origin
from carryover.router.metrics import RouterMetrics
from carryover.state import Record, Store, StoreUnavailable

__all__ = ["keeps_new_pins", "relieve", "relieve_forever", "share_to_release"]

log = logging.getLogger("carryover.pressure")

#: Gives a claimed record's handle back to D (and settles it in the ledger as released).
Release = Callable[[Instance, Record], Awaitable[bool]]

_RELEASES_AT_ONCE = 16  # one-token P requests: a burst of them must not crowd out turns


def keeps_new_pins(
    usage: float, *, limit: float, pinned_tokens: int = 0, capacity: float = 0.0
) -> bool:
    """Whether a turn ending on a D at ``usage`` keeps its pin of ``pinned_tokens``: not at or
    above ``limit``, and only if the D keeps room for another request of that size
    (``capacity``: tokens its cache holds; 0, not known, skips that rule). Relief frees what is
    held; under a steady stream of turns the pins that arrive meanwhile would take its place,
    so a full D takes no new ones. And where one conversation's context is a large share of
    D, a limit in shares of D is not enough: pins up to it leave too little room to admit the
    next such turn, which waits until relief or a pin's TTL makes some."""
    if usage >= limit:
        return False
    return capacity <= 0 or (1.0 - usage) * capacity >= pinned_tokens


def share_to_release(usage: float, held: int, *, high_water: float, low_water: float) -> int:
    """How many of ``held`` handles to give back at ``usage`` (fraction of the KV cache in
    use): none below ``high_water``; else the share of them whose blocks are the excess over
    ``low_water``, taking the held handles as what fills the cache (at least one)."""
    if held <= 0 or usage < high_water or usage <= 0:
        return 0
    share = (usage - low_water) / usage
    return min(held, max(1, math.ceil(held * share)))


async def relieve(
    store: Store,
    decodes: Iterable[Instance],
    release: Release,
    ledger: HandleLedger,
    metrics: RouterMetrics,
    *,
    high_water: float,
    low_water: float,
    now: float,
    period: float,
) -> int:
    """One pass: the decode instances at or above ``high_water`` (their usage as last probed)
    give back handles (largest holders' oldest first), each by the one process whose turn it is this ``period``.
    Returns how many were given back."""
    pressured = [i for i in decodes if i.kv_usage >= high_water]
    pressured = [
        i for i in pressured if await store.take_turn(f"relieve:{i.name}", period, now=now)
    ]
    if not pressured:
        return 0
    held = await store.held([i.name for i in pressured], now=now)
    gate = asyncio.Semaphore(_RELEASES_AT_ONCE)

    async def give_back(instance: Instance, record: Record) -> None:
        async with gate:
            await release(instance, record)

    given_back = 0
    for instance in pressured:
        stats = held[instance.name]
        # held() drops what expired unclaimed and counts it once: keep that count.
        metrics.held_expired.labels(instance.name).inc(stats.expired)
        # Shadowed handles (Record.shadowed) would free next to nothing: only the others
        # are given back, in the share their blocks are of what fills D.
        count = share_to_release(
            instance.kv_usage, stats.releasable, high_water=high_water, low_water=low_water
        )
        if count == 0:
            continue
        oldest = await store.claim_oldest(instance.name, count, now=now)
        records = oldest.records
        if oldest.withheld:
            ledger.lost(Origin.RELIEVED, Event.NOT_DURABLE, oldest.withheld)
            log.warning(
                "%d handles claimed without a replica's acknowledgement: left to D's TTL",
                oldest.withheld,
                extra={"instance": instance.name},
            )
        await asyncio.gather(*(give_back(instance, r) for r in records))
        given_back += len(records)
        log.info(
            "decode KV at %.0f%%: gave back %d of its %d held handles, largest holders' oldest first",
            100 * instance.kv_usage,
            len(records),
            stats.count,
            extra={"instance": instance.name},
        )
    return given_back


async def relieve_forever(
    store: Store,
    decodes: Callable[[], list[Instance]],
    release: Release,
    ledger: HandleLedger,
    metrics: RouterMetrics,
    *,
    high_water: float,
    low_water: float,
    interval: float,
    clock: Callable[[], float],
) -> None:
    """A pass every ``interval`` (the load probes' cadence: usage is as fresh as that). A pass
    that finds no instance above the mark costs nothing but the check."""
    while True:
        try:
            await relieve(
                store,
                decodes(),
                release,
                ledger,
                metrics,
                high_water=high_water,
                low_water=low_water,
                now=clock(),
                period=interval,
            )
        except StoreUnavailable as exc:
            metrics.store_errors.labels("relieve").inc()
            log.debug("no handles given back: %s", exc)
        await asyncio.sleep(interval)
