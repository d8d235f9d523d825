"""Decode instances found by DNS (``dns://NAME:PORT``), with an injected resolver: an address
that appears takes turns from its first healthy probe; one that disappears takes no new
turn, and the handles stored for it are given back through P (counted); a failed or empty
resolution keeps the members it had."""

from __future__ import annotations

import asyncio
from typing import Any

from litestar.testing import AsyncTestClient

from carryover.router.config.load import load_config
from carryover.router.fleet.discovery import DnsSet, members_of
from carryover.router.http.app import create_app
from carryover.router.metrics import RouterMetrics
from tests.support.metrics import parse
from tests.support.waiting import eventually
from tests.unit.router.fakes import FakeEngine, FakeFleet, assert_ledger_balanced
from tests.unit.router.test_turn_in_process import history


class Resolver:
    """What the name resolves to now; an exception to raise instead, once."""

    def __init__(self, *addresses: str) -> None:
        self.addresses = list(addresses)
        self.fail: OSError | None = None
        self.asked: list[tuple[str, int]] = []

    async def __call__(self, name: str, port: int) -> list[str]:
        self.asked.append((name, port))
        if self.fail is not None:
            error, self.fail = self.fail, None
            raise error
        return list(self.addresses)


def _metrics(app: Any) -> dict[str, float]:
    metrics: RouterMetrics = app.state.services.metrics
    return parse(metrics.render().decode())


async def _now(value: Any) -> Any:
    return value


async def until(read: Any, accept: Any = bool, *, what: str) -> Any:
    """``read()`` once ``accept`` takes it (the app's loops run meanwhile)."""
    return await eventually(lambda: _now(read()), accept, what=what)


async def test_decode_instances_follow_their_dns_name() -> None:
    p = FakeEngine("prefill", "p0:8000")
    d1, d2 = FakeEngine("decode", "10.0.0.1:8000"), FakeEngine("decode", "10.0.0.2:8000")
    fleet = FakeFleet(p, d1)  # d2 is not up yet: its address resolves, it refuses connections
    resolver = Resolver("10.0.0.1")
    config = load_config(
        ["--prefill", p.url, "--decode", "dns://decode.svc:8000", "--health-interval", "0.05"]
        + ["--expose-path-header"],
        environ={},
    )
    app = create_app(config, transport=fleet, seed=0, resolver=resolver)
    pool_of = lambda: app.state.services.pool  # noqa: E731

    async def chat(conversation: str, turns: int) -> str:
        body = {"messages": history(turns), "conversation_id": conversation}
        r = await client.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        return str(r.headers.get("x-carryover-path", ""))

    async with AsyncTestClient(app=app) as client:
        assert resolver.asked[0] == ("decode.svc", 8000)
        assert [i.name for i in pool_of().decodes()] == ["10.0.0.1:8000"]
        assert await chat("c1", 1) == "cold-miss"
        assert len(d1.holds) == 1  # c1's handle, stored

        # A new address joins once it answers a probe: not before.
        resolver.addresses = ["10.0.0.1", "10.0.0.2"]
        await until(lambda: len(pool_of().decodes()), lambda n: n == 2, what="d2 found")
        now = asyncio.get_running_loop().time
        assert not pool_of().by_name["10.0.0.2:8000"].available(now())
        assert (
            _metrics(app).get("carryover_instances_discovered_total{change=joined,role=decode}", 0)
            == 1
        )
        fleet.engines[d2.host] = d2
        await until(lambda: pool_of().by_name["10.0.0.2:8000"].healthy, what="d2 probed healthy")
        assert _metrics(app)["carryover_instances_discovered_total{change=joined,role=decode}"] == 2

        # A failed and an empty resolution change nothing.
        resolver.fail = OSError("Temporary failure in name resolution")
        resolver.addresses = []
        await until(
            lambda: _metrics(app).get(
                "carryover_discovery_errors_total{name=dns://decode.svc:8000}"
            ),
            lambda errors: (errors or 0) >= 2,
            what="a failed and an empty resolution",
        )
        assert len(pool_of().decodes()) == 2

        # d1 leaves: no new turn goes there, and c1's handle on it is given back through P.
        resolver.addresses = ["10.0.0.2"]
        await until(
            lambda: [i.name for i in pool_of().decodes()],
            lambda names: names == ["10.0.0.2:8000"],
            what="d1 gone",
        )
        await until(lambda: not d1.holds, what="c1's handle given back")
        assert len(p.releases) == 1
        metrics = _metrics(app)
        assert metrics["carryover_instances_discovered_total{change=left,role=decode}"] == 1
        assert metrics["carryover_handle_fates_total{cause=instance_gone,fate=released}"] == 1
        assert not [k for k in metrics if "10.0.0.1:8000" in k and "instance_up" in k]
        d1_turns = len(d1.requests)
        assert await chat("c1", 2) == "cold-miss"  # its record went with d1: it starts over
        assert len(d1.requests) == d1_turns and d2.requests
    assert_ledger_balanced(app)


def test_members_change_only_on_an_answer_and_keep_ipv6_in_brackets() -> None:
    dns = DnsSet(load_config(["--decode", "dns://d.svc:8000"], environ={}).models[0].decode[0])
    current = ["http://10.0.0.1:8000"]
    assert members_of(dns, current, None).left == []
    assert members_of(dns, current, []).left == []
    change = members_of(dns, current, ["fd00::2", "10.0.0.1"])
    assert [c.url for c in change.joined] == ["http://[fd00::2]:8000"] and change.left == []
    assert members_of(dns, current, ["10.0.0.3"]).left == current


def test_each_member_gets_its_own_kv_event_endpoints() -> None:
    config = load_config(
        ["--decode", "dns://d.svc:8000", "--kv-events", "dns://d.svc:8000=tcp://{address}:5557"],
        environ={},
    )
    dns = DnsSet(config.models[0].decode[0])
    (member,) = members_of(dns, [], ["fd00::7"]).joined
    assert member.kv_events == "tcp://[fd00::7]:5557" and member.url == "http://[fd00::7]:8000"
