"""``/metrics`` names tenants, their request counts and every engine's address: where anyone
but this machine's users can reach the router (api keys set, or a host beyond loopback) it
is the operators', behind the admin key."""

from __future__ import annotations

import json

import httpx
import pytest

from carryover.router.config.load import load_config
from carryover.router.http.app import create_app
from carryover.state import MemoryStore
from tests.explore.engines import Engines
from tests.explore.schedules import KEYS, NOW, until

_ENGINES = ["--prefill", "http://p0:8000", "--decode", "http://d0:8000"]


async def _scrape(
    args: list[str], environ: dict[str, str], headers: dict[str, str]
) -> httpx.Response:
    config = load_config([*_ENGINES, "--health-interval", "3600", *args], environ=environ)
    engines = Engines(["p0:8000"], ["d0:8000"])
    app = create_app(
        config, transport=engines, store=MemoryStore(clock=lambda: NOW), clock=lambda: NOW
    )
    async with (
        app.lifespan(),
        httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://r") as client,
    ):
        await until(lambda: all(r.name for r in app.state.services.models), "the model's name")
        return await client.get("/metrics", headers=headers)


_TENANTS = {"CARRYOVER_API_KEYS": json.dumps(KEYS), "CARRYOVER_ADMIN_KEY": "sk-admin"}


@pytest.mark.parametrize(
    "headers",
    [{}, {"Authorization": "Bearer k1"}, {"Authorization": "Bearer sk-wrong"}],
    ids=["no key", "a tenant's key", "a wrong key"],
)
async def test_a_tenant_listeners_metrics_need_the_admin_key(headers: dict[str, str]) -> None:
    reply = await _scrape([], _TENANTS, headers)
    assert reply.status_code == 401
    error = reply.json()["error"]
    assert error["code"] == 401 and "admin key" in error["message"]
    assert "carryover_" not in reply.text and "p0:8000" not in reply.text


async def test_the_admin_key_reads_a_tenant_listeners_metrics() -> None:
    reply = await _scrape([], _TENANTS, {"Authorization": "Bearer sk-admin"})
    assert reply.status_code == 200
    assert "carryover_turns_total" in reply.text


async def test_beyond_loopback_without_keys_the_metrics_are_the_operators_too() -> None:
    args = ["--host", "0.0.0.0", "--allow-unauthenticated"]
    refused = await _scrape(args, {}, {})
    assert refused.status_code == 401
    admitted = await _scrape(args, {"CARRYOVER_ADMIN_KEY": "sk-admin"}, {})
    assert admitted.status_code == 401
    read = await _scrape(
        args, {"CARRYOVER_ADMIN_KEY": "sk-admin"}, {"Authorization": "Bearer sk-admin"}
    )
    assert read.status_code == 200


async def test_a_loopback_router_without_keys_serves_its_metrics_to_its_machine() -> None:
    reply = await _scrape([], {}, {})
    assert reply.status_code == 200 and "carryover_turns_total" in reply.text
