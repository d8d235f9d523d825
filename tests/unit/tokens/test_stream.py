"""Coalescing a streamed answer's derender calls: budgets in tokens and time, the first token
never held back, one state per choice."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import msgspec
import pytest

from carryover.router.relay import DecodeOutput
from carryover.router.render.chat_template import ChatTemplate
from carryover.router.tokens.answers import StreamMender
from carryover.router.tokens.stream import Coalescer, derendered_stream


class FakeRenderServer:
    """Derenders each token id ``i`` to the text ``<i>``; records every call."""

    def __init__(self) -> None:
        self.calls: list[dict[str, Any]] = []

    async def derender_chunk(
        self,
        chunk: dict[str, Any],
        state: dict[str, Any] | None,
        prompt_ids: list[int],
        request: dict[str, Any],
        *,
        chat: bool,
    ) -> tuple[dict[str, Any], dict[str, Any]]:
        self.calls.append({"chunk": chunk, "state": state})
        choices = []
        for part in chunk["choices"]:
            text = "".join(f"<{i}>" for i in part["token_ids"])
            choices.append(
                {
                    "index": part["index"],
                    "delta": {"content": text or None},
                    "finish_reason": part["finish_reason"],
                    "logprobs": None,
                }
            )
        seen = (state or {}).get("seen", 0) + sum(len(p["token_ids"]) for p in chunk["choices"])
        return {"id": "generate-tokens-r", "choices": choices, "usage": chunk["usage"]}, {
            "seen": seen
        }


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _coalescer(server: FakeRenderServer, clock: Clock, tokens: int = 4, wait: float = 1.0):
    return Coalescer(
        server,  # type: ignore[arg-type]
        {"messages": []},
        [1, 2, 3],
        chat=True,
        mender=StreamMender(client_wants_ids=False, chat=True),
        max_tokens=tokens,
        max_wait=wait,
        clock=clock,
    )


def _gen(ids: list[int], index: int = 0, finish: str | None = None) -> dict[str, Any]:
    return {
        "request_id": "generate-tokens-r",
        "choices": [{"index": index, "token_ids": ids, "finish_reason": finish, "logprobs": None}],
    }


def _texts(frames: list[bytes]) -> list[str]:
    out = []
    for frame in frames:
        obj = msgspec.json.decode(frame[len(b"data: ") :])
        out += [c["delta"]["content"] or "" for c in obj["choices"]]
    return out


async def test_the_first_token_goes_out_at_once_then_batches_of_the_budget() -> None:
    server, clock = FakeRenderServer(), Clock()
    coalescer = _coalescer(server, clock, tokens=4)
    assert _texts(await coalescer.feed(_gen([10]))) == ["<10>"]
    for token in (11, 12, 13):
        assert await coalescer.feed(_gen([token])) == []
    assert _texts(await coalescer.feed(_gen([14]))) == ["<11><12><13><14>"]
    assert _texts(await coalescer.feed(_gen([15], finish="length"))) == ["<15>"]
    assert len(server.calls) == 3
    # The state each call returned goes into the next one.
    assert server.calls[2]["state"] == {"seen": 5}


async def test_waiting_tokens_go_out_when_their_time_is_up() -> None:
    server, clock = FakeRenderServer(), Clock()
    coalescer = _coalescer(server, clock, tokens=100, wait=0.5)
    await coalescer.feed(_gen([1]))
    await coalescer.feed(_gen([2]))
    assert coalescer.due_in() == pytest.approx(0.5)
    clock.now += 0.2
    assert coalescer.due_in() == pytest.approx(0.3)
    clock.now += 0.3
    assert _texts(await coalescer.feed(_gen([3]))) == ["<2><3>"]
    assert coalescer.due_in() is None


async def test_each_choice_keeps_its_own_state() -> None:
    server, clock = FakeRenderServer(), Clock()
    coalescer = _coalescer(server, clock, tokens=2)
    await coalescer.feed(_gen([1], index=0))
    await coalescer.feed(_gen([7], index=1))
    await coalescer.feed(_gen([2, 3], index=0))
    await coalescer.feed(_gen([8, 9], index=1))
    by_choice: dict[int, list[Any]] = {0: [], 1: []}
    for call in server.calls:
        (part,) = call["chunk"]["choices"]  # one choice per derender call
        by_choice[part["index"]].append(call["state"])
    assert by_choice[0] == [None, {"seen": 1}]
    assert by_choice[1] == [None, {"seen": 1}]


async def test_a_silent_engine_does_not_hold_waiting_tokens() -> None:
    """The stream driver flushes on the time budget while D sends nothing."""
    server = FakeRenderServer()
    coalescer = Coalescer(
        server,  # type: ignore[arg-type]
        {"messages": []},
        [1],
        chat=True,
        mender=StreamMender(client_wants_ids=False, chat=True),
        max_tokens=100,
        max_wait=0.01,
    )
    release = asyncio.Event()

    async def events() -> AsyncIterator[bytes]:
        yield msgspec.json.encode(_gen([2]))
        await release.wait()  # D is silent until the held token went out
        yield msgspec.json.encode(_gen([3], finish="stop"))
        yield b"[DONE]"

    output = DecodeOutput(client_wants_ids=False)
    stream = derendered_stream(msgspec.json.encode(_gen([1])), events(), coalescer, output)
    got = [await anext(stream), await anext(stream)]
    assert _texts(got) == ["<1>", "<2>"]  # <2> went out while D was silent
    release.set()
    rest = [frame async for frame in stream]
    assert _texts(rest) == ["<3>"]
    assert output.output_ids == [1, 2, 3] and output.finish_reason == "stop"


async def test_logprobs_the_server_leaves_out_are_resolved_here() -> None:
    tokenizer = ChatTemplate.qwen3().tokenizer
    ids = list(tokenizer.encode(" plain text", add_special_tokens=False).ids)
    coalescer = Coalescer(
        FakeRenderServer(),  # answers logprobs: null, as vLLM's parsed path does
        {"messages": []},
        [1],
        chat=True,
        mender=StreamMender(client_wants_ids=False, chat=True),
        max_tokens=1,
        max_wait=1.0,
        logprob_tokenizer=tokenizer,
    )
    tokens = []
    for token_id in ids:
        chunk = _gen([token_id])
        chunk["choices"][0]["logprobs"] = {
            "content": [{"token_id": token_id, "logprob": -0.25, "top_logprobs": []}]
        }
        for frame in await coalescer.feed(chunk):
            choice = msgspec.json.decode(frame[len(b"data: ") :])["choices"][0]
            tokens += [(e["token"], e["logprob"]) for e in choice["logprobs"]["content"]]
    assert tokens == [(" plain", -0.25), (" text", -0.25)]
