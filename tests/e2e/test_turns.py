"""Multi-turn conversations through ``carryover serve`` and simulated engines."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest

from tests.support.stack import (
    Stack,
    chat_turn,
    completion_turn,
    held_by,
    p_pulled,
    reference_chat,
    stack,
)
from tests.support.waiting import eventually

TEXT = (
    "Tell me, turn {i}, about rivers and stones in an old garden, what the seasons do to them, "
    "and how a patient gardener should look after every corner of it through the year. "
)


async def run_chat_conversation(
    s: Stack, conversation: str, turns: int, *, stream: bool, thinking: bool = False, **extra: Any
) -> list[str | None]:
    """Every turn's answer must equal the reference engine's answer to the same messages."""
    messages: list[dict[str, Any]] = []
    paths = []
    kwargs = {"chat_template_kwargs": {"enable_thinking": True}} if thinking else {}
    for i in range(turns):
        messages.append({"role": "user", "content": TEXT.format(i=i) * 2})
        got = await chat_turn(
            s.client,
            s.router.url,
            messages,
            stream=stream,
            conversation_id=conversation,
            **kwargs,
            **extra,
        )
        assert got.status == 200, got.raw
        want = await reference_chat(s, messages, **kwargs, **extra)
        assert got.content == want.content, f"turn {i + 1} differs from the no-reuse reference"
        paths.append(got.path)
        messages.append({"role": "assistant", "content": got.content})
    return paths


@pytest.mark.parametrize("stream", [False, True])
async def test_five_turns_reuse_and_match_the_reference(tmp_path: Path, stream: bool) -> None:
    # P keeps no prefix cache: what it did not compute it pulled, so its counter shows that
    # each turn pulled all of what D held of the conversation (a truncated handle would not).
    p_sim = {"enable_prefix_caching": False}
    async with stack(tmp_path, sim={"threshold": 16}, p_sim=p_sim) as s:
        extra = {"stream_options": {"include_usage": True}} if stream else {}
        messages: list[dict[str, Any]] = []
        paths, held, pulled = [], 0, []
        for i in range(5):
            messages.append({"role": "user", "content": TEXT.format(i=i) * 2})
            before = await p_pulled(s)
            got = await chat_turn(
                s.client, s.router.url, messages, stream=stream, conversation_id="five", **extra
            )
            assert got.status == 200, got.raw
            assert got.content == (await reference_chat(s, messages)).content, f"turn {i + 1}"
            assert await p_pulled(s) - before == held, f"turn {i + 1}"
            pulled.append(held)
            paths.append(got.path)
            # D holds every token it ran: the prompt and the answer but its last token.
            held = got.usage["prompt_tokens"] + got.usage["completion_tokens"] - 1
            messages.append({"role": "assistant", "content": got.content})
        assert paths == ["cold-miss"] + ["reuse"] * 4
        # The log line of each turn says what its outcome says: path, tokens pulled, the
        # claimed handle's fate.
        lines = [json.loads(line) for line in s.router.log().splitlines() if '"turn"' in line]
        turns = [line for line in lines if line.get("msg") == "turn"]
        assert [t["path"] for t in turns] == paths
        assert [t["reused_tokens"] for t in turns] == pulled
        assert [t["handle"] for t in turns] == ["none"] + ["sent"] * 4
        # ... and where each leg ran (no KV events here: nothing the index said).
        p, d = (urlsplit(server.url).netloc for server in (s.prefill[0], s.decode[0]))
        assert all(t["prefill"] == p and t["decode"] == d for t in turns), turns
        assert not any("prefill_indexed_tokens" in t for t in turns)


@pytest.mark.parametrize("stream", [False, True])
async def test_usage_counts_as_cached_only_what_no_engine_computed(
    tmp_path: Path, stream: bool
) -> None:
    # D got the whole prompt's KV from P: its own count would call all of it cached. What the
    # client reads is P's count (local hits plus what it pulled from D's handle).
    async with stack(tmp_path, sim={"threshold": 16}) as s:
        extra: dict[str, Any] = {"stream_options": {"include_usage": True}} if stream else {}
        messages = [{"role": "user", "content": TEXT.format(i=0) * 2}]
        cached, prompt = [], []
        for turn in range(2):
            got = await chat_turn(
                s.client, s.router.url, messages, stream=stream, conversation_id="u", **extra
            )
            assert got.status == 200, got.raw
            usage = got.usage
            cached.append(usage["prompt_tokens_details"]["cached_tokens"])
            prompt.append(usage["prompt_tokens"])
            assert cached[-1] < prompt[-1]
            messages += [
                {"role": "assistant", "content": got.content},
                {"role": "user", "content": TEXT.format(i=turn + 1)},
            ]
        assert got.path == "reuse"
        assert cached[0] == 0  # turn 1: nothing was cached anywhere
        assert cached[1] >= prompt[0] // 16 * 16  # turn 2: turn 1's blocks, from D's handle


async def test_reasoning_template_mismatch_is_caught(tmp_path: Path) -> None:
    # Qwen3 strips <think> of earlier turns: the next prompt diverges where D's output began.
    async with stack(tmp_path, sim={"threshold": 16}) as s:
        paths = await run_chat_conversation(
            s, "think", 4, stream=False, thinking=True, max_tokens=60
        )
        assert all(p in ("partial", "cold-mismatch") for p in paths[1:]), paths
        assert "partial" in paths


async def test_unchecked_reuse_gives_wrong_answers(tmp_path: Path) -> None:
    # The measurement arm without the check reproduces vLLM #43094 through the router.
    async with stack(
        tmp_path,
        sim={"threshold": 16},
        router_flags=("--planner", "carryover.bench.unchecked:plan_unchecked"),
    ) as s:
        with pytest.raises(AssertionError, match="differs from the no-reuse reference"):
            await run_chat_conversation(
                s, "unchecked", 3, stream=False, thinking=True, max_tokens=60
            )


async def test_completions_with_token_ids_reuse_fully(tmp_path: Path) -> None:
    async with stack(tmp_path, sim={"threshold": 16}) as s:
        prompt = list(range(1000, 1300))
        for turn in range(4):
            got = await completion_turn(
                s.client,
                s.router.url,
                prompt,
                conversation_id="ids",
                return_token_ids=True,
                ignore_eos=True,
            )
            assert got.status == 200, got.raw
            want = await completion_turn(
                s.client, s.reference.url, prompt, return_token_ids=True, ignore_eos=True
            )
            assert got.token_ids == want.token_ids
            assert got.path == ("cold-miss" if turn == 0 else "reuse")
            assert got.body["choices"][0]["prompt_token_ids"] == prompt  # asked for: given
            prompt = prompt + got.token_ids + list(range(2000 + turn * 50, 2050 + turn * 50))


async def test_streamed_completions_and_text_prompt(tmp_path: Path) -> None:
    async with stack(tmp_path, sim={"threshold": 16}) as s:
        got = await completion_turn(
            s.client, s.router.url, TEXT.format(i=0) * 3, stream=True, conversation_id="txt"
        )
        want = await completion_turn(s.client, s.reference.url, TEXT.format(i=0) * 3)
        assert got.content == want.content and got.chunks[-1] == "[DONE]"
        assert all("kv_transfer_params" not in c for c in got.chunks if isinstance(c, dict))


async def test_without_conversation_id_plain_pd_and_handle_released(tmp_path: Path) -> None:
    async with stack(tmp_path) as s:
        messages = [{"role": "user", "content": TEXT.format(i=0)}]
        for _ in range(2):
            got = await chat_turn(s.client, s.router.url, messages)
            assert got.status == 200 and got.path == "no-conversation"
            assert got.content == (await reference_chat(s, messages)).content

        # D's pinned blocks are released right away instead of waiting for the TTL.
        await eventually(lambda: held_by(s), lambda h: h == [], what="D's pins are released")


async def test_conversation_id_from_headers(tmp_path: Path) -> None:
    async with stack(tmp_path, sim={"threshold": 16}) as s:
        messages = [{"role": "user", "content": TEXT.format(i=0) * 2}]
        first = await chat_turn(s.client, s.router.url, messages, header_id="hdr-1")
        messages += [
            {"role": "assistant", "content": first.content},
            {"role": "user", "content": TEXT.format(i=1)},
        ]
        second = await chat_turn(s.client, s.router.url, messages, header_id="hdr-1")
        assert (first.path, second.path) == ("cold-miss", "reuse")
        r = await s.client.post(
            s.router.url + "/v1/chat/completions",
            json={"model": "sim-qwen3", "messages": messages, "max_tokens": 5},
            headers={"X-Session-ID": "sess-1"},
        )
        assert r.status_code == 200 and r.headers["x-carryover-path"] == "cold-miss"


async def test_responses_never_leak_engine_fields(tmp_path: Path) -> None:
    async with stack(tmp_path) as s:
        messages = [{"role": "user", "content": TEXT.format(i=0)}]
        for stream in (False, True):
            got = await chat_turn(
                s.client, s.router.url, messages, stream=stream, conversation_id=f"leak-{stream}"
            )
            for forbidden in (
                "kv_transfer_params",
                "remote_engine_id",
                "remote_block_ids",
                "remote_host",
                "token_ids",
                "prompt_token_ids",
            ):
                assert forbidden not in got.raw
            asked = await chat_turn(
                s.client, s.router.url, messages, stream=stream, return_token_ids=True
            )
            assert asked.token_ids and "kv_transfer_params" not in asked.raw


async def test_two_routers_share_one_redis(tmp_path: Path, redis_server: Any) -> None:
    import uuid

    flags = ("--redis", redis_server.url)
    async with stack(tmp_path, routers=2, router_flags=flags, sim={"threshold": 16}) as s:
        conversation = f"shared-{uuid.uuid4().hex}"
        messages = [{"role": "user", "content": TEXT.format(i=0) * 2}]
        first = await chat_turn(s.client, s.routers[0].url, messages, conversation_id=conversation)
        messages += [
            {"role": "assistant", "content": first.content},
            {"role": "user", "content": TEXT.format(i=1)},
        ]
        second = await chat_turn(s.client, s.routers[1].url, messages, conversation_id=conversation)
        assert (first.path, second.path) == ("cold-miss", "reuse")
        assert second.content == (await reference_chat(s, messages)).content


async def test_official_openai_client(tmp_path: Path) -> None:
    from openai import AsyncOpenAI

    async with stack(tmp_path, sim={"threshold": 16}) as s:
        client = AsyncOpenAI(base_url=s.router.url + "/v1", api_key="unused")
        messages: list[Any] = [{"role": "user", "content": TEXT.format(i=0) * 2}]
        first = await client.chat.completions.with_raw_response.create(
            model="sim-qwen3",
            messages=messages,
            max_tokens=30,
            extra_body={"conversation_id": "oa-1"},
        )
        answer = first.parse().choices[0].message.content
        messages += [
            {"role": "assistant", "content": answer},
            {"role": "user", "content": TEXT.format(i=1)},
        ]
        second = await client.chat.completions.with_raw_response.create(
            model="sim-qwen3",
            messages=messages,
            max_tokens=30,
            extra_headers={"X-Conversation-ID": "oa-1"},
        )
        assert second.headers["x-carryover-path"] == "reuse"
        stream = await client.chat.completions.create(
            model="sim-qwen3",
            messages=messages,
            max_tokens=30,
            stream=True,
            extra_body={"conversation_id": "oa-2"},
        )
        text = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
        assert text == (await reference_chat(s, messages, max_tokens=30)).content
        models = await client.models.list()
        assert [m.id for m in models.data] == ["sim-qwen3"]
        await client.close()
