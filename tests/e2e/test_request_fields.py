"""Request fields that change what the engine runs never meet a handle (router/fields.py):
against the simulator, which truncates and echoes as vLLM 0.33 does."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

from tests.support.metrics import ascrape
from tests.support.stack import chat_turn, completion_turn, held_by, reference_chat, stack
from tests.support.waiting import eventually

TEXT = "Turn {i}: the harbour at dawn, the boats going out, the gulls and the tide. "


async def test_truncated_completion_is_run_unchecked_and_right(tmp_path: Path) -> None:
    # vLLM truncates a token prompt to its last k ids: with the stored handle attached, P
    # would pull the history for ids it no longer runs and answer wrongly.
    async with stack(tmp_path, sim={"threshold": 16}) as s:
        conversation = uuid.uuid4().hex
        prompt = (
            await s.client.post(
                s.reference.url + "/tokenize",
                json={"model": "sim-qwen3", "prompt": TEXT.format(i=1) * 4},
            )
        ).json()["tokens"]
        first = await completion_turn(s.client, s.router.url, prompt, conversation_id=conversation)
        assert first.path == "cold-miss", first.raw
        longer = prompt + first.token_ids + prompt[:30]
        extra = {"truncate_prompt_tokens": len(longer) - 40}
        got = await completion_turn(
            s.client, s.router.url, longer, conversation_id=conversation, **extra
        )
        want = await completion_turn(s.client, s.reference.url, longer, **extra)
        assert got.status == 200, got.raw
        assert got.content == want.content
        assert got.path == "cold-unchecked"
        router = await ascrape(s.client, s.router.url)
        assert router["carryover_turns_unchecked_total{field=truncate_prompt_tokens}"] == 1
        assert router["carryover_handles_released_total{cause=reuse_disabled}"] == 1


async def test_chat_echo_is_unchecked_and_the_next_turn_reuses_what_d_ran(
    tmp_path: Path,
) -> None:
    async with stack(tmp_path, sim={"threshold": 16}) as s:
        conversation = uuid.uuid4().hex
        messages: list[dict[str, Any]] = [{"role": "user", "content": TEXT.format(i=1) * 3}]
        first = await chat_turn(s.client, s.router.url, messages, conversation_id=conversation)
        messages += [
            {"role": "assistant", "content": first.content},
            {"role": "user", "content": TEXT.format(i=2)},
        ]
        echoed = await chat_turn(
            s.client, s.router.url, messages, conversation_id=conversation, echo=True
        )
        assert echoed.status == 200 and echoed.path == "cold-unchecked", echoed.raw
        assert echoed.content == (await reference_chat(s, messages, echo=True)).content
        # D's own ids of the echoed turn are stored: the next plain turn reuses them.
        messages += [
            {"role": "assistant", "content": echoed.content},
            {"role": "user", "content": TEXT.format(i=3)},
        ]
        third = await chat_turn(s.client, s.router.url, messages, conversation_id=conversation)
        assert third.path == "reuse"
        assert third.content == (await reference_chat(s, messages)).content
        await eventually(lambda: held_by(s), lambda h: len(h) == 1, what="one pinned handle")


async def test_refused_fields_are_a_400(tmp_path: Path) -> None:
    async with stack(tmp_path) as s:
        for extra in ({"use_beam_search": True}, {"ec_transfer_params": {"x": 1}}):
            got = await chat_turn(
                s.client, s.router.url, [{"role": "user", "content": "hi"}], **extra
            )
            assert got.status == 400, got.raw
            assert got.body["error"]["param"] == next(iter(extra))
