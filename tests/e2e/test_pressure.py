"""A decode instance whose KV cache fills with pinned turns gets its oldest handles back."""

from __future__ import annotations

import uuid
from pathlib import Path

from tests.e2e.test_failures import Chat, router_counter
from tests.support.metrics import ascrape
from tests.support.secrets import admin_key_flags
from tests.support.stack import Stack, stack
from tests.support.waiting import eventually

ADMIN = {"authorization": "Bearer admin-key"}
HIGH, LOW = 0.6, 0.3


async def _stored(s: Stack, chats: list[Chat]) -> list[bool]:
    found = []
    for chat in chats:
        r = await s.client.get(f"{s.router.url}/admin/conversations/{chat.id}", headers=ADMIN)
        assert r.status_code in (200, 404), r.text
        found.append(r.status_code == 200)
    return found


async def _decode_usage(s: Stack) -> float:
    metrics = await ascrape(s.client, s.decode[0].url)
    return next(v for k, v in metrics.items() if k.startswith("vllm:kv_cache_usage_perc"))


async def test_a_full_decode_gives_back_its_oldest_handles(tmp_path: Path) -> None:
    flags = (
        *admin_key_flags(tmp_path, "admin-key"),
        "--health-interval",
        "0.2",
        "--decode-kv-high-water",
        str(HIGH),
        "--decode-kv-low-water",
        str(LOW),
    )
    # 32 blocks of 16 tokens: one-turn conversations pin D's blocks until it holds more than
    # the high-water mark (each pins what it does not share with the others' prompt).
    released = "carryover_handles_released_total{cause=decode_pressure}"
    async with stack(
        tmp_path, router_flags=flags, sim={"threshold": 16}, d_sim={"num_blocks": 32}
    ) as s:
        chats: list[Chat] = []
        while await _decode_usage(s) <= HIGH and not await router_counter(s, released):
            assert len(chats) < 16, "D never filled past the high-water mark"
            chats.append(Chat(s, f"pressure-{len(chats)}-{uuid.uuid4().hex[:6]}"))
            assert await chats[-1].turn() == "cold-miss"

        await eventually(
            lambda: router_counter(s, released),
            lambda n: n > 0,
            what="the router giving back handles of the full decode instance",
        )
        usage = await eventually(
            lambda: _decode_usage(s), lambda u: u < HIGH, what="D's KV use below the mark"
        )
        assert usage < HIGH
        stored = await _stored(s, chats)
        # The turn that took D past the mark kept its pin unless the router's probe saw D
        # that full before the turn ended (then it was given back at once, decode_full).
        at_commit = await router_counter(s, "carryover_handles_released_total{cause=decode_full}")
        assert at_commit in (0, 1)
        held = stored[: len(stored) - int(at_commit)]
        # Oldest first: what is gone is a prefix of the conversations in the order they
        # started, and the newest one held is kept.
        kept_from = held.index(True)
        assert kept_from > 0 and all(held[kept_from:]), stored
        # A conversation given back starts over cold (and right); a kept one reuses.
        assert await chats[0].turn() == "cold-miss"
        assert await chats[len(held) - 1].turn() == "reuse"
