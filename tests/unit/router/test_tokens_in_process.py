"""A tokens-only model in process: the real app and turn logic, a fake render server and fake
``--tokens-only`` engines on the transport seam (tests/unit/router/fakes.py)."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import pytest
from litestar.testing import AsyncTestClient

from carryover.router.config.load import load_config
from carryover.router.http.app import create_app
from tests.support.waiting import eventually
from tests.unit.router.fakes import ANSWER, FakeEngine, FakeFleet, assert_ledger_balanced, encode
from tests.unit.router.test_turn_in_process import handles_sent_to_p, history


@dataclass
class TokensRig:
    client: AsyncTestClient[Any]
    p: FakeEngine
    d: FakeEngine
    render: FakeEngine

    async def chat(self, messages: list[dict[str, Any]], **extra: Any) -> Any:
        body = {"messages": messages, "conversation_id": "c1", **extra}
        return await self.client.post("/v1/chat/completions", json=body)


def _app(render_host: str, *flags: str) -> tuple[Any, FakeEngine, FakeEngine, FakeEngine]:
    p, d = FakeEngine("prefill", "p0:8000"), FakeEngine("decode", "d0:8000")
    render = FakeEngine("render", "r0:8000")
    config = load_config(
        [
            *("--prefill", p.url, "--decode", d.url, "--engine-api", "tokens"),
            *("--render", f"http://{render_host}", "--expose-path-header"),
            *("--health-interval", "0.05"),
            *flags,
        ],
        environ={"CARRYOVER_ADMIN_KEY": "k"},
    )
    return create_app(config, transport=FakeFleet(p, d, render), seed=0), p, d, render


@pytest.fixture
async def rig() -> AsyncIterator[TokensRig]:
    app, p, d, render = _app("r0:8000")
    async with AsyncTestClient(app=app) as client:
        await eventually(lambda: client.get("/ready"), lambda r: r.status_code == 200, what="ready")
        yield TokensRig(client, p, d, render)
    assert_ledger_balanced(app)


async def test_turns_run_render_generate_and_derender_and_reuse_the_handle(rig: TokensRig) -> None:
    first = await rig.chat(history(1), max_tokens=16)
    assert first.status_code == 200, first.text
    body = first.json()
    assert body["choices"][0]["message"]["content"] == ANSWER
    assert body["id"].startswith("chatcmpl-") and "kv_transfer_params" not in body
    # Engines got token ids only, on generate; the 16 the render server left out went back in.
    (p_leg,) = rig.p.requests
    assert p_leg["sampling_params"]["max_tokens"] == 1 and "messages" not in p_leg
    (d_leg,) = rig.d.requests
    assert d_leg["sampling_params"]["max_tokens"] == 16 and d_leg["return_token_ids"]
    second = await rig.chat(history(2))
    assert second.status_code == 200 and second.headers["x-carryover-path"] == "reuse"
    assert handles_sent_to_p(rig.p) == rig.p.reads and len(rig.p.reads) == 1


async def test_a_released_handle_goes_to_p_over_generate(rig: TokensRig) -> None:
    assert (await rig.chat(history(1))).status_code == 200
    r = await rig.client.delete("/v1/conversations/c1")
    assert r.status_code == 200
    await eventually(lambda: _async(rig.p.releases), what="a release on P")
    release = rig.p.requests[-1]
    assert release["token_ids"] == [0] and release["kv_transfer_params"]["remote_num_tokens"] == 0


async def _async(value: Any) -> Any:
    return value


async def _stream(rig: TokensRig, messages: list[dict[str, Any]]) -> str:
    frames = []
    async with rig.client.stream(
        "POST",
        "/v1/chat/completions",
        json={"messages": messages, "conversation_id": "c1", "stream": True},
    ) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                frames.append(json.loads(line[6:]))
    return "".join(f["choices"][0]["delta"].get("content") or "" for f in frames if f["choices"])


async def test_a_streamed_turn_is_derendered_and_its_handle_captured(rig: TokensRig) -> None:
    assert await _stream(rig, history(1)) == ANSWER
    # First token alone, then batches of 8: a dozen tokens in three derender calls.
    calls = [q for q in rig.render.requests if q["path"].endswith("derender") and q["stream"]]
    assert len(calls) == 3
    # The stream returned no handle: one token after the whole sequence, on the same D,
    # took it (computed by D alone).
    streamed, capture = rig.d.requests[-2:]
    answer = encode(ANSWER)
    assert capture["token_ids"] == [*streamed["token_ids"], *answer]
    assert capture["sampling_params"] == {"max_tokens": 1}
    assert capture["kv_transfer_params"] == {"do_remote_prefill": False} and not capture["stream"]
    # Stored, and shadowed: the stream's own pin holds the same blocks, so pressure relief
    # would free next to nothing by giving it back.
    store = rig.client.app.state.services.store
    held = (await store.held([rig.d.host], now=time.time()))[rig.d.host]
    assert (held.count, held.releasable) == (1, 0)
    second = await rig.chat(history(2))
    assert second.headers["x-carryover-path"] == "reuse"
    assert len(handles_sent_to_p(rig.p)) == 1


async def test_a_stream_without_any_token_is_done_and_goes_on(rig: TokensRig) -> None:
    # D's generate stream is its [DONE] alone: no frame for the client, still a whole turn.
    rig.d.answer = ""
    async with rig.client.stream(
        "POST",
        "/v1/chat/completions",
        json={"messages": history(1), "conversation_id": "c1", "stream": True},
    ) as r:
        assert r.status_code == 200
        assert await r.aread() == b"data: [DONE]\n\n"
    rig.d.answer = ANSWER
    assert (await rig.chat(history(2))).status_code == 200


async def test_a_failed_capture_leaves_the_streamed_turn_without_a_handle(rig: TokensRig) -> None:
    rig.d.fail_next = [0, 500]  # the stream is served, the capture fails
    assert await _stream(rig, history(1)) == ANSWER
    assert (await rig.chat(history(2))).headers["x-carryover-path"] == "cold-miss"
    metrics = (await rig.client.get("/metrics")).text
    assert 'carryover_turns_without_handle_total{cause="capture_failed"} 1.0' in metrics


async def test_without_capture_a_streamed_turn_stores_no_handle() -> None:
    app, p, d, render = _app("r0:8000", "--no-capture-streamed-handles")
    async with AsyncTestClient(app=app) as client:
        await eventually(lambda: client.get("/ready"), lambda r: r.status_code == 200, what="ready")
        rig = TokensRig(client, p, d, render)
        assert await _stream(rig, history(1)) == ANSWER
        assert len(d.requests) == 1
        assert (await rig.chat(history(2))).headers["x-carryover-path"] == "cold-miss"
        metrics = (await client.get("/metrics")).text
        assert 'carryover_turns_without_handle_total{cause="streamed_generate"} 1.0' in metrics


async def test_stop_strings_are_refused_before_any_engine_sees_them(rig: TokensRig) -> None:
    r = await rig.chat(history(1), stop=["x"])
    assert r.status_code == 400 and r.json()["error"]["param"] == "stop"
    assert rig.p.requests == [] and rig.d.requests == []


async def test_no_render_server_is_a_clear_503() -> None:
    app, p, d, _ = _app("gone:8000")
    async with AsyncTestClient(app=app) as client:
        ready = await client.get("/ready")
        assert ready.status_code == 503
        r = await client.post(
            "/v1/chat/completions", json={"messages": history(1), "conversation_id": "c1"}
        )
        assert r.status_code == 503 and "render server" in r.json()["error"]["message"]
        assert p.requests == [] and d.requests == []
