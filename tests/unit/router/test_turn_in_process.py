"""The turn in process: the real app and turn logic, fake engines on the transport seam, the
in-process store and a clock the test drives. Fast, and exact about what each engine got."""

from __future__ import annotations

import asyncio
import gc
import json
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import pytest
from litestar.testing import AsyncTestClient

from carryover.router.config.load import load_config
from carryover.router.http.app import create_app
from tests.support.metrics import turns_by_path
from tests.support.waiting import eventually
from tests.unit.router.fakes import ANSWER, FakeEngine, FakeFleet, assert_ledger_balanced


@dataclass
class Rig:
    client: AsyncTestClient[Any]
    p: FakeEngine
    d: FakeEngine
    now: list[float]
    app: Any

    async def chat(
        self, messages: list[dict[str, Any]], conversation: str = "c1", **extra: Any
    ) -> tuple[int, str | None, dict[str, Any]]:
        body = {"messages": messages, "conversation_id": conversation, **extra}
        before = await self.turns()
        r = await self.client.post("/v1/chat/completions", json=body)
        path = r.headers.get("x-carryover-path")
        # The metric counts the turn once, under the path the client was told.
        counted = await self.turns() - before
        assert counted == (Counter({path: 1}) if r.status_code == 200 else Counter()), counted
        return r.status_code, path, r.json()

    async def turns(self) -> Counter[str]:
        return await turns_by_path(self.client, "")


@pytest.fixture
async def rig() -> AsyncIterator[Rig]:
    p, d = FakeEngine("prefill", "p0:8000"), FakeEngine("decode", "d0:8000")
    config = load_config(
        ["--prefill", p.url, "--decode", d.url, "--expose-path-header", "--health-interval", "60"],
        environ={},
    )
    now = [1_000_000.0]
    app = create_app(config, transport=FakeFleet(p, d), clock=lambda: now[0], seed=0)
    async with AsyncTestClient(app=app) as client:
        yield Rig(client, p, d, now, app)
    assert_ledger_balanced(app)


def history(turns: int) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = []
    for i in range(turns):
        if messages:
            messages.append({"role": "assistant", "content": ANSWER})
        messages.append({"role": "user", "content": f"question {i}: " + "x" * 80})
    return messages


def handles_sent_to_p(p: FakeEngine) -> list[str]:
    return [
        r["kv_transfer_params"]["remote_request_id"]
        for r in p.requests
        if r["kv_transfer_params"].get("do_remote_decode")
        and r["kv_transfer_params"].get("remote_block_ids")
    ]


async def test_a_handle_is_read_once_and_the_client_sees_nothing_internal(rig: Rig) -> None:
    status, path, body = await rig.chat(history(1))
    assert (status, path) == (200, "cold-miss")
    assert not {"kv_transfer_params", "prompt_token_ids"} & body.keys()
    assert "token_ids" not in body["choices"][0]
    (first,) = rig.d.holds
    status, path, _ = await rig.chat(history(2))
    assert (status, path) == (200, "reuse")
    assert rig.p.reads == [first] and handles_sent_to_p(rig.p) == [first]
    # P and D ran exactly the checked ids.
    p_ids = rig.p.requests[-1]["kv_transfer_params"]["prompt_token_ids"]
    d_ids = rig.d.requests[-1]["kv_transfer_params"]["prompt_token_ids"]
    assert p_ids == d_ids


async def second_turn_gives_its_pin_back(rig: Rig) -> None:
    """Turn 2, after D's state changed: it reuses turn 1's handle, and D's new pin is given
    back through P at once (``decode_full``), not stored for the next turn."""
    await rig.app.state.services.pool.probe_all()
    status, path, _ = await rig.chat(history(2))
    assert (status, path) == (200, "reuse")
    assert rig.d.holds == {} and len(rig.p.releases) == 1
    metrics = (await rig.client.get("/metrics")).text
    assert 'carryover_handles_released_total{cause="decode_full"} 1.0' in metrics


async def test_a_turn_ending_on_a_full_decode_keeps_no_pin(rig: Rig) -> None:
    await rig.chat(history(1))
    rig.d.kv_usage = 0.85  # above the high-water mark (0.8)
    await second_turn_gives_its_pin_back(rig)
    status, path, _ = await rig.chat(history(3))
    assert (status, path) == (200, "cold-miss")
    rig.d.kv_usage = 0.5
    await rig.app.state.services.pool.probe_all()
    await rig.chat(history(4))
    status, path, _ = await rig.chat(history(5))
    assert (status, path) == (200, "reuse")


async def test_a_turn_too_large_for_what_its_decode_has_left_keeps_no_pin(rig: Rig) -> None:
    """Below the pin limit, but with less room left on D than the turn's own size: pins up
    to the limit would leave no room to admit the next such turn."""
    first = await rig.chat(history(1))
    assert first[:2] == (200, "cold-miss")
    pinned = next(iter(rig.d.holds.values())).tokens  # turn 2's pin is larger still
    rig.d.kv_usage = 0.5  # below the limit (0.8)
    rig.d.kv_blocks = -(-2 * pinned // 16) - 1  # half of it free: a token short of the turn
    await second_turn_gives_its_pin_back(rig)
    rig.d.kv_blocks *= 8  # room for it: the next turn's pin is kept
    await rig.app.state.services.pool.probe_all()
    await rig.chat(history(3))
    status, path, _ = await rig.chat(history(4))
    assert (status, path) == (200, "reuse")


async def test_an_expired_record_is_never_sent(rig: Rig) -> None:
    await rig.chat(history(1))
    rig.now[0] += 480 - 5 - 25  # the record's lifetime, on the router's clock
    status, path, _ = await rig.chat(history(2))
    assert (status, path) == (200, "cold-miss")
    assert handles_sent_to_p(rig.p) == []


async def test_a_refused_handle_is_retried_cold_and_never_sent_again(rig: Rig) -> None:
    await rig.chat(history(1))
    rig.d.holds.clear()  # D let it go (its TTL): P answers the read with a 500
    status, path, _ = await rig.chat(history(2))
    assert (status, path) == (200, "cold-error")
    assert len(handles_sent_to_p(rig.p)) == 1
    metrics = (await rig.client.get("/metrics")).text
    assert 'carryover_retries_total{cause="prefill_handle_rejected"} 1.0' in metrics


async def test_a_failed_decode_runs_again_with_a_fresh_cold_prefill(rig: Rig) -> None:
    await rig.chat(history(1))
    rig.d.fail_next = [500]
    status, path, _ = await rig.chat(history(2))
    assert (status, path) == (200, "cold-error")
    assert len(rig.d.requests) == 3  # turn 1, the failed attempt, the retry
    assert len(handles_sent_to_p(rig.p)) == 1  # the retry's P leg ran cold


async def test_a_decode_that_could_not_be_reached_in_time_is_tried_again(rig: Rig) -> None:
    # A connect deadline means the request never left: the only D is tried again, not given
    # up on as a D that timed out while running the request.
    await rig.chat(history(1))
    rig.d.connect_timeouts = 1
    status, path, _ = await rig.chat(history(2))
    assert (status, path) == (200, "cold-error")
    assert len(rig.d.requests) == 2  # turn 1 and the retry; the first attempt never arrived


async def test_a_streamed_turn_is_stripped_and_stored(rig: Rig) -> None:
    body = {"messages": history(1), "conversation_id": "c1", "stream": True}
    async with rig.client.stream("POST", "/v1/chat/completions", json=body) as r:
        events = [line[6:] async for line in r.aiter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    for event in events[:-1]:
        chunk = json.loads(event)
        assert not {"kv_transfer_params", "prompt_token_ids"} & chunk.keys()
    status, path, _ = await rig.chat(history(2))
    assert (status, path) == (200, "reuse")


async def test_the_conversation_of_another_tenant_or_model_is_not_reached(rig: Rig) -> None:
    await rig.chat(history(1), conversation="mine")
    status, path, _ = await rig.chat(history(2), conversation="other")
    assert (status, path) == (200, "cold-miss")
    assert handles_sent_to_p(rig.p) == []


async def test_the_conversation_header_is_configurable() -> None:
    p, d = FakeEngine("prefill", "p0:8000"), FakeEngine("decode", "d0:8000")
    config = load_config(
        ["--prefill", p.url, "--decode", d.url, "--expose-path-header"]
        + ["--health-interval", "60", "--conversation-header", "X-Correlation-ID"],
        environ={},
    )
    app = create_app(config, transport=FakeFleet(p, d), seed=0)
    async with AsyncTestClient(app=app) as client:
        paths = []
        for turns, headers in (
            (1, {"X-Correlation-ID": "bench-7"}),
            (2, {"x-correlation-id": "bench-7"}),
            (3, {"X-Conversation-ID": "bench-7"}),  # no longer a conversation header
        ):
            body = {"messages": history(turns)}
            r = await client.post("/v1/chat/completions", json=body, headers=headers)
            assert r.status_code == 200, r.text
            paths.append(r.headers.get("x-carryover-path"))
        assert paths == ["cold-miss", "reuse", "no-conversation"]  # the 3rd would reuse as bench-7


async def test_a_committed_answer_is_tokenized_before_the_next_turn_needs_it() -> None:
    # In-process rendering (unchecked here: the fakes tokenize otherwise): once turn 1 is
    # stored, its answer's span is tokenized off the path, and turn 2 tokenizes only its new
    # user message.
    p, d = FakeEngine("prefill", "p0:8000"), FakeEngine("decode", "d0:8000")
    config = load_config(
        [
            "--prefill",
            p.url,
            "--decode",
            d.url,
            "--health-interval",
            "60",
            "--render-backend",
            "local",
        ],
        environ={},
    )
    app = create_app(config, transport=FakeFleet(p, d), seed=0)
    async with AsyncTestClient(app=app) as client:
        (runtime,) = app.state.services.models
        spans = runtime.renderer._template.spans
        body = {"messages": history(1), "conversation_id": "w1"}
        assert (await client.post("/v1/chat/completions", json=body)).status_code == 200
        # The warm-up runs after the answer went out: wait for it (the app has its own loop).
        await eventually(
            lambda: asyncio.to_thread(lambda: f"assistant\n{ANSWER}" in spans._spans),
            what="the answer's span tokenized",
        )
        misses = spans.misses
        body = {"messages": history(2), "conversation_id": "w1"}
        assert (await client.post("/v1/chat/completions", json=body)).status_code == 200
        assert spans.misses - misses == 1


async def test_a_turn_leaves_no_cycle_of_the_routers_own_for_the_collector(rig: Rig) -> None:
    # A served worker's heap is frozen and its full collections are rare (router/memory.py):
    # a cycle per request (a cancelled task's traceback holding the request) piles up, with
    # everything it holds, until one runs. What stays is the test client's own (httpx).
    async def turns(count: int) -> None:
        for i in range(count):
            body = {"messages": history(1), "conversation_id": f"c{i}"}
            assert (await rig.client.post("/v1/chat/completions", json=body)).status_code == 200
            body = {**body, "conversation_id": f"s{i}", "stream": True}
            assert (await rig.client.post("/v1/chat/completions", json=body)).status_code == 200

    await turns(2)
    gc.collect()
    gc.disable()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        await turns(5)
        gc.collect()
        kinds = Counter(type(o).__name__ for o in gc.garbage)
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()
    routers = {"DisconnectWatch", "Task", "Future", "CancelledError", "frame", "coroutine"}
    assert not {kind: n for kind, n in kinds.items() if kind in routers}
