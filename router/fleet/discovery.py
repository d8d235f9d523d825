"""Engines found by DNS: a ``dns://NAME:PORT`` entry stands for every address NAME resolves
to (A and AAAA records; a Kubernetes headless Service lists its ready pods so), re-resolved
at every health probe round (docs/discovery.md).

An address that appears joins its model and role once a health probe answers; one that no
longer resolves leaves at once: no new request goes there, what runs there finishes, and the
handles stored for it are given back while its process may still run (a pod leaves the
Service's records when it starts terminating), or left to its TTL when it no longer answers.
A resolution that fails or finds nothing keeps the last members: a DNS outage must not empty
the fleet. Pure decisions here; the pool applies them."""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import socket
from collections.abc import Awaitable, Callable, Iterable
from urllib.parse import urlsplit

import msgspec

from carryover.router.config import InstanceConfig
from carryover.router.config.engines import ADDRESS
from carryover.router.fleet.instance import Instance
from carryover.router.handles.fates import Event
from carryover.router.handles.ledger import HandleLedger, Origin
from carryover.state import Record, Store

__all__ = [
    "Change",
    "DnsSet",
    "Resolver",
    "give_back_left",
    "members_of",
    "resolve",
]

log = logging.getLogger("carryover.discovery")

#: ``(name, port) -> addresses``; tests inject their own.
Resolver = Callable[[str, int], Awaitable[list[str]]]


async def resolve(name: str, port: int) -> list[str]:
    """Every address ``name`` resolves to (IPv4 and IPv6), as the system resolver sees it."""
    infos = await asyncio.get_running_loop().getaddrinfo(name, port, type=socket.SOCK_STREAM)
    return sorted({str(info[4][0]) for info in infos})


class DnsSet(msgspec.Struct, frozen=True):
    """One ``dns://`` entry of a model's prefill or decode list."""

    entry: InstanceConfig

    @property
    def name(self) -> str:
        host = urlsplit(self.entry.url).hostname
        assert host is not None  # InstanceConfig checked it
        return host

    @property
    def port(self) -> int:
        port = urlsplit(self.entry.url).port
        assert port is not None
        return port

    def instance(self, address: str) -> InstanceConfig:
        """The instance at ``address``: its URL and KV event endpoints, and the entry's other
        settings."""
        host = f"[{address}]" if ipaddress.ip_address(address).version == 6 else address
        events, replay = (
            e.replace(ADDRESS, host) if e is not None else None
            for e in (self.entry.kv_events, self.entry.kv_events_replay)
        )
        return msgspec.structs.replace(
            self.entry, url=f"http://{host}:{self.port}", kv_events=events, kv_events_replay=replay
        )


class Change(msgspec.Struct, frozen=True):
    joined: list[InstanceConfig]
    left: list[str]  # URLs


def members_of(dns: DnsSet, current: Iterable[str], resolved: list[str] | None) -> Change:
    """What changes in ``dns``'s members (their URLs: ``current``) when its name resolved to
    ``resolved`` (``None``: the resolution failed). Nothing changes on a failure or an empty
    answer."""
    if not resolved:
        return Change([], [])
    wanted = {dns.instance(address).url: dns.instance(address) for address in resolved}
    have = set(current)
    return Change(
        joined=[config for url, config in sorted(wanted.items()) if url not in have],
        left=sorted(have - set(wanted)),
    )


#: Gives a claimed record's handle back to D through P (settled as released in the ledger).
Release = Callable[[Instance, Record], Awaitable[bool]]


async def give_back_left(
    store: Store, instance: Instance, release: Release, ledger: HandleLedger, *, now: float
) -> int:
    """The handles stored for an instance that left: claimed (atomically: with several
    routers each record is taken once) and given back if it still answered its last probe,
    else left to its TTL. Returns how many were claimed."""
    held = (await store.held([instance.name], now=now))[instance.name]
    if held.releasable == 0:
        return 0
    oldest = await store.claim_oldest(instance.name, held.releasable, now=now)
    if oldest.withheld:
        ledger.lost(Origin.RELIEVED, Event.NOT_DURABLE, oldest.withheld)
    if instance.healthy:
        await asyncio.gather(*(release(instance, record) for record in oldest.records))
    else:
        for record in oldest.records:
            ledger.record(ledger.hold(Origin.RELIEVED, record.handle), Event.INSTANCE_UNREACHABLE)
    log.info(
        "instance %s left: %d of its handles %s",
        instance.name,
        len(oldest.records),
        "given back" if instance.healthy else "left to expire",
        extra={"instance": instance.name},
    )
    return len(oldest.records) + oldest.withheld
