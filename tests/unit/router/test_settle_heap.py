"""A served worker freezes its startup heap once the app is up (router/memory.py): the
garbage collector's full passes then walk only what serving allocates."""

from __future__ import annotations

import gc
from pathlib import Path

import pytest
from litestar.testing import AsyncTestClient

from carryover.router.http.asgi import build
from carryover.router.memory import settle_heap
from tests.support.served import hand_a_worker_its_config


def test_settling_moves_every_live_object_out_of_the_collectors_generations() -> None:
    survivor = [object() for _ in range(1_000)]
    try:
        settle_heap()
        assert gc.get_freeze_count() >= len(survivor)
    finally:
        gc.unfreeze()


async def test_a_worker_built_for_serving_settles_its_heap_after_startup(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    hand_a_worker_its_config(tmp_path, monkeypatch)
    gc.unfreeze()
    app = build()
    assert gc.get_freeze_count() == 0
    try:
        async with AsyncTestClient(app=app):
            assert gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()
