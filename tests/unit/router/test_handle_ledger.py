"""Every handle the router holds reaches exactly one final state (router/handles/ledger.py): the
leaks an outside review found, each with the turn that used to leave a handle in nobody's
hands. In process: fake engines on the transport seam, a store the test can hold still."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import httpx
from litestar import Litestar

from carryover.router.config.load import load_config
from carryover.router.http.app import create_app
from carryover.state import Committed, ConversationKey, MemoryStore, Record
from tests.support.metrics import parse
from tests.support.waiting import eventually
from tests.unit.router.fakes import FakeEngine, FakeFleet, assert_ledger_balanced
from tests.unit.router.test_turn_in_process import handles_sent_to_p, history


class HeldStore(MemoryStore):
    """The in-process store, whose claim or commit waits while ``hold`` is set."""

    def __init__(self) -> None:
        super().__init__()
        self.hold: str | None = None
        self.reached = asyncio.Event()
        self.go = asyncio.Event()

    async def _wait(self, call: str) -> None:
        if self.hold == call:
            self.reached.set()
            await self.go.wait()

    async def claim(self, key: ConversationKey) -> Record | None:
        await self._wait("claim")
        return await super().claim(key)

    async def commit(
        self, key: ConversationKey, record: Record, *, now: float, running_for: float | None = None
    ) -> Committed:
        await self._wait("commit")
        return await super().commit(key, record, now=now, running_for=running_for)


@contextlib.asynccontextmanager
async def router(
    *engines: FakeEngine, store: MemoryStore | None = None
) -> AsyncIterator[tuple[Litestar, httpx.AsyncClient]]:
    """The app on this event loop (its lifespan, and requests through httpx's ASGI
    transport): a request cancelled here is cancelled in the router, as a client leaving."""
    args = ["--expose-path-header", "--health-interval", "60"]
    for engine in engines:
        args += [f"--{engine.role}", engine.url]
    app = create_app(load_config(args, environ={}), transport=FakeFleet(*engines), store=store)
    async with (
        app.lifespan(),
        httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://r") as client,
    ):
        await eventually(lambda: client.get("/ready"), lambda r: r.status_code == 200, what="ready")
        models = app.state.services.models
        await eventually(
            lambda: _async([r.name for r in models if r.name]), bool, what="the model's name"
        )
        yield app, client
    assert_ledger_balanced(app)


async def chat(client: httpx.AsyncClient, turns: int, **extra: Any) -> httpx.Response:
    body = {"messages": history(turns), "conversation_id": "c1", **extra}
    return await client.post("/v1/chat/completions", json=body)


def fates(text: str) -> dict[str, float]:
    return {k: v for k, v in parse(text).items() if k.startswith("carryover_handle_fates_total{")}


async def test_a_handle_whose_prefill_could_not_be_reached_goes_to_the_next_prefill() -> None:
    p0, p1 = FakeEngine("prefill", "p0:8000"), FakeEngine("prefill", "p1:8000")
    d = FakeEngine("decode", "d0:8000")
    async with router(p0, p1, d) as (_, client):
        assert (await chat(client, 1)).status_code == 200
        (handle,) = d.holds
        first = p0 if p0.requests else p1
        first.connect_timeouts = 1  # the next request to the P that served turn 1 never leaves
        second = await chat(client, 2)
        assert second.status_code == 200 and second.headers["x-carryover-path"] == "reuse"
        other = p1 if first is p0 else p0
        assert handles_sent_to_p(other) == [handle] and other.reads == [handle]


async def test_a_stream_that_breaks_after_the_handle_gives_it_back() -> None:
    p, d = FakeEngine("prefill", "p0:8000"), FakeEngine("decode", "d0:8000")
    d.break_after_handle = True
    async with router(p, d) as (_, client):
        body = {"messages": history(1), "conversation_id": "c1", "stream": True}
        async with client.stream("POST", "/v1/chat/completions", json=body) as r:
            events = [line async for line in r.aiter_lines() if line.startswith("data: ")]
        assert '"error"' in events[-2] and events[-1] == "data: [DONE]"
        released = await eventually(
            lambda: _async(list(p.releases)), lambda r: len(r) == 1, what="D's handle released"
        )
        assert released[0].startswith("d-") and not d.holds
        text = (await client.get("/metrics")).text
        assert fates(text) == {"carryover_handle_fates_total{cause=stream_broken,fate=released}": 1}


async def _async(value: Any) -> Any:
    return value


async def test_a_client_that_leaves_during_the_commit_leaves_the_turn_stored() -> None:
    p, d = FakeEngine("prefill", "p0:8000"), FakeEngine("decode", "d0:8000")
    store = HeldStore()
    async with router(p, d, store=store) as (_, client):
        store.hold = "commit"
        request = asyncio.create_task(chat(client, 1))
        await store.reached.wait()
        request.cancel()  # the client leaves while its turn is committed
        store.hold = None
        store.go.set()  # the store answers after the cancellation reached the turn
        with contextlib.suppress(asyncio.CancelledError):
            await request
        key = ConversationKey("default", "fake-model", "c1")
        stored = await eventually(lambda: store.get(key), lambda r: r is not None, what="stored")
        assert stored is not None and stored.turn == 1
        second = await chat(client, 2)
        assert second.headers["x-carryover-path"] == "reuse"


async def test_a_client_that_leaves_during_the_claim_has_the_claimed_handle_released() -> None:
    p, d = FakeEngine("prefill", "p0:8000"), FakeEngine("decode", "d0:8000")
    store = HeldStore()
    async with router(p, d, store=store) as (_, client):
        assert (await chat(client, 1)).status_code == 200
        (handle,) = d.holds
        store.hold = "claim"
        request = asyncio.create_task(chat(client, 2))
        await store.reached.wait()
        request.cancel()  # the client leaves while its conversation's record is claimed
        store.go.set()  # the store answers after the cancellation reached the turn
        with contextlib.suppress(asyncio.CancelledError):
            await request
        await eventually(lambda: _async(p.releases), lambda r: r == [handle], what="released")
        text = (await client.get("/metrics")).text
        assert fates(text)["carryover_handle_fates_total{cause=client_gone,fate=released}"] == 1


async def test_a_turn_whose_prefill_ran_other_ids_is_not_stored() -> None:
    p, d = FakeEngine("prefill", "p0:8000"), FakeEngine("decode", "d0:8000")
    p.own_ids = True  # D's prompt KV comes from ids nobody checked
    async with router(p, d) as (_, client):
        assert (await chat(client, 1)).status_code == 200
        second = await chat(client, 2)
        assert second.headers["x-carryover-path"] == "cold-miss"  # nothing was stored
        text = (await client.get("/metrics")).text
        mismatch = "carryover_handle_fates_total{cause=prefill_prompt_mismatch,fate=released}"
        assert fates(text)[mismatch] == 2
