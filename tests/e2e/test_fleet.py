"""Admin actions for a fleet: a drain sent to one worker of one replica reaches every worker of
every replica (router/fleet/draining.py, through the shared store)."""

from __future__ import annotations

from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from tests.support.metrics import ascrape
from tests.support.secrets import admin_key_flags, register
from tests.support.stack import Stack, chat_turn, stack
from tests.support.waiting import eventually

ADMIN = {"authorization": "Bearer admin-key"}


async def _finished(s: Stack, index: int) -> float:
    values = await ascrape(s.client, s.decode[index].url)
    return sum(v for k, v in values.items() if k.startswith("vllm:request_success_total{"))


async def test_a_drain_reaches_every_worker_of_every_replica(
    tmp_path: Path, redis_server: Any
) -> None:
    register("admin-key")
    flags = ("--redis", redis_server.url, "--workers", "2", *admin_key_flags(tmp_path, "admin-key"))
    async with stack(tmp_path, decodes=2, routers=2, router_flags=flags) as s:
        name = urlsplit(s.decode[0].url).netloc
        drained = await s.client.post(
            f"{s.routers[0].url}/admin/instances/{name}/drain", headers=ADMIN
        )
        assert drained.status_code == 200 and drained.json()["draining"] is True
        series = f"carryover_instance_draining{{server={name}}}"
        for router in s.routers:  # the gauge is 1 once every live worker of it has the drain
            await eventually(
                lambda url=router.url: ascrape(s.client, url),
                lambda values: values.get(series) == 1,
                what=f"every worker of {router.url} draining {name}",
            )
        before = await _finished(s, 0)
        for turn in range(8):
            router = s.routers[turn % 2]
            got = await chat_turn(s.client, router.url, [{"role": "user", "content": f"Hi {turn}"}])
            assert got.status == 200, got.raw
        assert await _finished(s, 0) == before  # not one new request on the drained D

        undone = await s.client.post(
            f"{s.routers[1].url}/admin/instances/{name}/drain?undo=1", headers=ADMIN
        )
        assert undone.json()["draining"] is False
        for router in s.routers:
            await eventually(
                lambda url=router.url: ascrape(s.client, url),
                lambda values: values.get(series) == 0,
                what=f"{name} back in service on every worker of {router.url}",
            )
