"""``/ready`` says whether this router can serve a turn now (router/http/readiness.py)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

import httpx

from carryover.router.config.load import load_config
from carryover.router.http.app import create_app
from tests.support.waiting import eventually
from tests.unit.router.fakes import FakeEngine, FakeFleet


@contextlib.asynccontextmanager
async def router(*args: str, engines: list[FakeEngine]) -> AsyncIterator[httpx.AsyncClient]:
    config = load_config([*args, "--health-interval", "0.05"], environ={})
    app = create_app(config, transport=FakeFleet(*engines))
    async with (
        app.lifespan(),
        httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://r") as client,
    ):
        yield client


async def _ready(client: httpx.AsyncClient) -> httpx.Response:
    return await client.get("/ready")


async def test_every_prefill_down_is_ready_only_where_decode_may_serve_alone() -> None:
    d = FakeEngine("decode", "d0:8000")
    # The P named here never answers (nothing listens at its address).
    for policy, status in (("decode-alone", 200), ("fail", 503)):
        args = ["--prefill", "http://p0:8000", "--decode", d.url]
        async with router(*args, "--when-prefill-down", policy, engines=[d]) as client:
            got = await eventually(
                lambda c=client: _ready(c),
                lambda r, want=status: (
                    r.status_code == want and (want == 200 or "prefill" in r.text)
                ),
                what=policy,
            )
            if status == 503:
                assert "no healthy prefill" in got.json()["error"]["message"]


async def test_a_model_no_engine_serves_is_not_ready() -> None:
    p, d = FakeEngine("prefill", "p0:8000"), FakeEngine("decode", "d0:8000")
    args = ["--prefill", p.url, "--decode", d.url, "--model", "sim-qwen3"]
    async with router(*args, engines=[p, d]) as client:
        got = await eventually(
            lambda: _ready(client), lambda r: "serves" in r.text, what="the engines' models read"
        )
        assert got.status_code == 503
        assert "no engine serves the model 'sim-qwen3'" in got.json()["error"]["message"]


async def test_an_unreachable_store_is_not_ready() -> None:
    p, d = FakeEngine("prefill", "p0:8000"), FakeEngine("decode", "d0:8000")
    args = ["--prefill", p.url, "--decode", d.url, "--redis", "redis://127.0.0.1:1/0"]
    async with router(*args, engines=[p, d]) as client:
        got = await eventually(
            lambda: _ready(client), lambda r: r.status_code == 503, what="not ready"
        )
        assert "conversation store does not answer" in got.json()["error"]["message"]
        assert (await client.get("/health")).status_code == 200  # alive all the same
