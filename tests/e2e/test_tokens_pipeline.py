"""Tokens-only engines behind ``carryover serve --engine-api tokens``: a simulated render
server renders and derenders, ``--tokens-only`` P and D run ``/inference/v1/generate``
(docs/tokens-pipeline.md). The reference engine serves the OpenAI API on the same weights."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.support.metrics import ascrape
from tests.support.stack import Stack, chat_turn, completion_turn, p_pulled, reference_chat, stack

TEXT = (
    "Tell me, turn {i}, about rivers and stones in an old garden, what the seasons do to them, "
    "and how a patient gardener should look after every corner of it through the year. "
)
THINKING = {"chat_template_kwargs": {"enable_thinking": True}}


async def counter(s: Stack, name: str) -> float:
    return (await ascrape(s.client, s.router.url)).get(name, 0.0)


def user(i: int) -> dict[str, Any]:
    return {"role": "user", "content": TEXT.format(i=i) * 2}


async def test_whole_turns_reuse_d_s_blocks_and_match_the_reference(tmp_path: Path) -> None:
    # P keeps no prefix cache: its counter shows each turn pulled all that D held.
    p_sim = {"enable_prefix_caching": False}
    async with stack(tmp_path, tokens=True, sim={"threshold": 16}, p_sim=p_sim) as s:
        assert s.render is not None
        checked = dict(s.render.calls)  # the startup check derendered its probes
        messages: list[dict[str, Any]] = []
        paths, held = [], 0
        for i in range(4):
            messages.append(user(i))
            before = await p_pulled(s)
            got = await chat_turn(s.client, s.router.url, messages, conversation_id="whole")
            assert got.status == 200, got.raw
            want = await reference_chat(s, messages)
            assert got.content == want.content
            assert got.body["id"].startswith("chatcmpl-")
            assert got.body["usage"]["completion_tokens"] == want.body["usage"]["completion_tokens"]
            assert await p_pulled(s) - before == held, f"turn {i + 1}"
            # D holds every token it ran: the prompt and the answer but its last token.
            held = got.usage["prompt_tokens"] + got.usage["completion_tokens"] - 1
            paths.append(got.path)
            messages.append({"role": "assistant", "content": got.content})
        assert paths == ["cold-miss", "reuse", "reuse", "reuse"]
        calls = {k: v - checked[k] for k, v in s.render.calls.items()}
        assert calls == {"render": 4, "derender": 4, "derender_chunk": 0}


@pytest.mark.parametrize("capture", [True, False])
async def test_streamed_turns_reuse_through_a_captured_handle(
    tmp_path: Path, capture: bool
) -> None:
    # vLLM's streamed generate returns no kv_transfer_params. With capture (the default), a
    # one-token request for the whole sequence on D takes the handle, answered from D's
    # prefix cache; without it, the turn after a stream is cold.
    flags = () if capture else ("--no-capture-streamed-handles",)
    # P keeps no prefix cache: its counter shows what each turn pulled, all of the handle's.
    p_sim = {"enable_prefix_caching": False}
    async with stack(
        tmp_path, tokens=True, sim={"threshold": 16}, p_sim=p_sim, router_flags=flags
    ) as s:
        messages: list[dict[str, Any]] = []
        paths, handle_tokens = [], 0
        for i, stream in enumerate((True, True, False)):
            messages.append(user(i))
            before = await p_pulled(s)
            extra = {"stream_options": {"include_usage": True}} if stream else {}
            got = await chat_turn(
                s.client, s.router.url, messages, conversation_id="mixed", stream=stream, **extra
            )
            assert got.status == 200, got.raw
            assert got.content == (await reference_chat(s, messages)).content
            if stream:
                assert got.chunks[-1] == "[DONE]"
                assert all(c["id"].startswith("chatcmpl-") for c in got.chunks[:-1])
            pulled = await p_pulled(s) - before
            assert pulled == (handle_tokens if got.path == "reuse" else 0), (i, got.path)
            sequence = got.usage["prompt_tokens"] + got.usage["completion_tokens"]
            # A captured handle covers the whole sequence (the capture computed its last
            # token); a whole answer's, all D ran: the sequence but its last token.
            handle_tokens = sequence if stream else sequence - 1
            paths.append(got.path)
            messages.append({"role": "assistant", "content": got.content})
        uncaptured = await counter(
            s, "carryover_turns_without_handle_total{cause=streamed_generate}"
        )
        if capture:
            assert paths == ["cold-miss", "reuse", "reuse"]
            assert uncaptured == 0
        else:
            assert paths == ["cold-miss", "cold-miss", "cold-miss"]
            assert uncaptured == 2


@pytest.mark.parametrize("stream", [False, True])
async def test_reasoning_is_split_as_the_reference_engine_splits_it(
    tmp_path: Path, stream: bool
) -> None:
    async with stack(tmp_path, tokens=True, reasoning_parser="qwen3") as s:
        assert s.render is not None
        messages = [user(0)]
        got = await chat_turn(
            s.client, s.router.url, messages, stream=stream, max_tokens=80, **THINKING
        )
        assert got.status == 200, got.raw
        want = await reference_chat(s, messages, max_tokens=80, **THINKING)
        wanted_reasoning = want.body["choices"][0]["message"]["reasoning_content"]
        assert wanted_reasoning
        if stream:
            reasoning = "".join(
                c["choices"][0]["delta"].get("reasoning") or ""
                for c in got.chunks[:-1]
                if c.get("choices")
            )
            # Derendered in batches: fewer calls than tokens, none held past the last.
            tokens = want.body["usage"]["completion_tokens"]
            assert 0 < s.render.calls["derender_chunk"] < tokens
        else:
            reasoning = got.body["choices"][0]["message"]["reasoning"]
        assert (reasoning, got.content) == (wanted_reasoning, want.content)


async def test_a_stream_no_parser_needs_is_detokenized_in_the_router(tmp_path: Path) -> None:
    async with stack(tmp_path, tokens=True) as s:
        assert s.render is not None
        messages = [user(0)]
        got = await chat_turn(s.client, s.router.url, messages, stream=True)
        assert got.status == 200, got.raw
        assert got.content == (await reference_chat(s, messages)).content
        assert s.render.calls["derender_chunk"] == 0


@pytest.mark.parametrize("stream", [False, True])
async def test_completions_reuse_and_match_the_reference(tmp_path: Path, stream: bool) -> None:
    async with stack(tmp_path, tokens=True, sim={"threshold": 16}) as s:
        prompt = list(range(1000, 1300))
        for turn in range(3):
            got = await completion_turn(
                s.client,
                s.router.url,
                prompt,
                conversation_id="c",
                stream=stream and turn == 2,
                return_token_ids=True,
                ignore_eos=True,
            )
            assert got.status == 200, got.raw
            want = await completion_turn(
                s.client, s.reference.url, prompt, return_token_ids=True, ignore_eos=True
            )
            assert (got.content, got.token_ids) == (want.content, want.token_ids)
            assert got.path == ("cold-miss" if turn == 0 else "reuse")
            if not got.chunks:
                assert got.body["id"].startswith("cmpl-")
            prompt = prompt + got.token_ids + list(range(2000 + turn * 50, 2050 + turn * 50))


async def test_the_render_server_down_is_a_503_and_turns_resume_when_it_returns(
    tmp_path: Path,
) -> None:
    async with stack(tmp_path, tokens=True) as s:
        assert s.render is not None
        messages = [user(0)]
        assert (await chat_turn(s.client, s.router.url, messages)).status == 200
        await s.render.stop()
        down = await chat_turn(s.client, s.router.url, messages)
        assert down.status == 503, down.raw
        assert "render server" in down.body["error"]["message"]
        await s.render.start()
        back = await chat_turn(s.client, s.router.url, messages)
        assert back.status == 200, back.raw


async def test_a_failed_derender_costs_the_answer_not_the_reuse(tmp_path: Path) -> None:
    async with stack(tmp_path, tokens=True, sim={"threshold": 16}) as s:
        assert s.render is not None
        messages = [user(0)]
        first = await chat_turn(s.client, s.router.url, messages, conversation_id="d")
        assert first.status == 200, first.raw
        messages += [{"role": "assistant", "content": first.content}, user(1)]
        await s.client.post(s.render.url + "/sim/faults", json={"fail_derender": 1})
        failed = await chat_turn(s.client, s.router.url, messages, conversation_id="d")
        assert failed.status == 503, failed.raw
        assert failed.body["error"]["type"]  # OpenAI's error shape
        # The failed turn's handle was stored before derendering: its retry finds it (P
        # already holds those blocks from the failed turn, so nothing more is pulled).
        retry = await chat_turn(s.client, s.router.url, messages, conversation_id="d")
        assert retry.status == 200, retry.raw
        assert retry.path in ("reuse", "partial")
        assert retry.content == (await reference_chat(s, messages)).content


async def test_decode_breaking_mid_stream_gives_an_error_event_and_done(tmp_path: Path) -> None:
    async with stack(tmp_path, tokens=True) as s:
        await s.client.post(s.decode[0].url + "/sim/faults", json={"drop_stream_after": 3})
        got = await chat_turn(s.client, s.router.url, [user(0)], stream=True)
        assert got.status == 200
        assert got.chunks[-1] == "[DONE]"
        assert "error" in got.chunks[-2]


async def test_a_handle_p_rejects_is_retried_cold(tmp_path: Path) -> None:
    async with stack(tmp_path, tokens=True, sim={"threshold": 16}) as s:
        messages = [user(0)]
        first = await chat_turn(s.client, s.router.url, messages, conversation_id="r")
        assert first.status == 200, first.raw
        messages += [{"role": "assistant", "content": first.content}, user(1)]
        await s.client.post(s.prefill[0].url + "/sim/faults", json={"fail_next": 1})
        got = await chat_turn(s.client, s.router.url, messages, conversation_id="r")
        assert (got.status, got.path) == (200, "cold-error"), got.raw
        assert got.content == (await reference_chat(s, messages)).content
        assert await counter(s, "carryover_retries_total{cause=prefill_handle_rejected}") == 1


async def test_stop_strings_are_refused_before_any_engine_runs(tmp_path: Path) -> None:
    async with stack(tmp_path, tokens=True) as s:
        got = await chat_turn(s.client, s.router.url, [user(0)], stop=["garden"])
        assert got.status == 400, got.raw
        assert got.body["error"]["param"] == "stop"
        for engine in (*s.prefill, *s.decode):
            ran = await ascrape(s.client, engine.url)
            assert not any(v for k, v in ran.items() if k.startswith("vllm:request_success"))
