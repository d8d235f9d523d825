"""Parallel and forked turns of one conversation."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from tests.support.metrics import ascrape
from tests.support.secrets import admin_key_flags
from tests.support.stack import chat_turn, reference_chat, stack
from tests.support.waiting import eventually

TEXT = "Turn {i}: rivers, stones and the patient gardener, season after season, in the old garden. "


async def test_parallel_turns_use_the_handle_once_and_keep_the_later_turn(tmp_path: Path) -> None:
    async with stack(
        tmp_path, sim={"threshold": 16}, router_flags=admin_key_flags(tmp_path, "adm")
    ) as s:
        history: list[dict[str, Any]] = [{"role": "user", "content": TEXT.format(i=0) * 2}]
        first = await chat_turn(s.client, s.router.url, history, conversation_id="par")
        history.append({"role": "assistant", "content": first.content})
        turn2 = [*history, {"role": "user", "content": TEXT.format(i=1)}]
        turn3 = [
            *turn2,
            {"role": "assistant", "content": "An answer the agent already has."},
            {"role": "user", "content": TEXT.format(i=2)},
        ]
        before = await ascrape(s.client, s.prefill[0].url)
        # Both are held at D until both have claimed and passed P: one claim then surely
        # finds the handle and the other nothing, whatever the machine's speed (without the
        # hold, a loaded machine can run one turn to its commit before the other claims).
        await s.client.post(s.decode[0].url + "/sim/faults", json={"hang": True})
        both = asyncio.gather(
            chat_turn(s.client, s.router.url, turn2, conversation_id="par"),
            chat_turn(s.client, s.router.url, turn3, conversation_id="par"),
        )
        done = "vllm:request_success_total:sum"
        await eventually(
            lambda: ascrape(s.client, s.prefill[0].url),
            lambda m: m.get(done, 0) == before.get(done, 0) + 2,
            what="both P legs",
        )
        await s.client.post(s.decode[0].url + "/sim/faults", json={"hang": False})
        a, b = await both
        assert a.status == b.status == 200
        assert sorted([a.path, b.path]).count("cold-miss") == 1  # exactly one got the handle
        assert a.content == (await reference_chat(s, turn2)).content
        assert b.content == (await reference_chat(s, turn3)).content
        after = await ascrape(s.client, s.prefill[0].url)
        key = "vllm:prompt_tokens_by_source_total{source=external_kv_transfer}"
        assert after[key] > before[key]
        record = await s.client.get(
            s.router.url + "/admin/conversations/par", headers={"Authorization": "Bearer adm"}
        )
        assert record.json()["turn"] == 3


async def test_forked_conversation_never_reuses_wrongly(tmp_path: Path) -> None:
    async with stack(tmp_path, sim={"threshold": 16}) as s:
        history: list[dict[str, Any]] = [{"role": "user", "content": TEXT.format(i=0) * 3}]
        first = await chat_turn(s.client, s.router.url, history, conversation_id="fork")
        history.append({"role": "assistant", "content": first.content})
        left = [*history, {"role": "user", "content": "left " + TEXT.format(i=1)}]
        right = [*history, {"role": "user", "content": "right " + TEXT.format(i=1)}]
        l1 = await chat_turn(s.client, s.router.url, left, conversation_id="fork")
        assert l1.path == "reuse"
        r1 = await chat_turn(s.client, s.router.url, right, conversation_id="fork")
        assert r1.path in ("partial", "cold-mismatch")  # diverges where the branches split
        assert l1.content == (await reference_chat(s, left)).content
        assert r1.content == (await reference_chat(s, right)).content
