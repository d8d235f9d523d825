"""A streamed tokens-only answer: D's token chunks derendered in batches.

vLLM's streaming derender takes one chunk per call and, with a reasoning or tool parser,
parses the whole output again on every call (vLLM 0.32 ``renderers/online_derenderer.py``;
a parser cache is vLLM issue #57571): one call per token costs O(n²) parsing. Here tokens are
held until ``stream_tokens`` of them wait or ``stream_interval`` has passed, then derendered
in one call; a choice's first tokens and its last are never held. One state per choice
(``n > 1``): the render server takes one choice per call.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import msgspec
from tokenizers import Tokenizer

from carryover.router.relay import DecodeOutput, parse_chunk
from carryover.router.tokens.answers import StreamMender
from carryover.router.tokens.logprobs import resolve_logprobs

__all__ = ["ChunkDerenderer", "Coalescer", "derendered_stream"]

_encoder = msgspec.json.Encoder()


class ChunkDerenderer(Protocol):
    """The render server's streaming derender (``RenderServerClient``), or this process's
    detokenizer standing in for it (``LocalDetokenizer``)."""

    async def derender_chunk(
        self,
        chunk: dict[str, Any],
        state: dict[str, Any] | None,
        prompt_ids: list[int],
        request: dict[str, Any],
        *,
        chat: bool,
    ) -> tuple[dict[str, Any], dict[str, Any]]: ...


@dataclass
class _Choice:
    index: int
    state: dict[str, Any] | None = None
    ids: list[int] = field(default_factory=list)
    logprobs: list[Any] = field(default_factory=list)
    has_logprobs: bool = False
    since: float | None = None  # when the oldest waiting token arrived
    context: list[int] = field(default_factory=list)  # last sampled ids, for logprob tokens
    sent_first: bool = False
    finish_reason: str | None = None
    stop_reason: Any = None


class Coalescer:
    """Turns D's generate chunks into derendered OpenAI chunks (as SSE frames)."""

    def __init__(
        self,
        server: ChunkDerenderer,
        request: dict[str, Any],
        prompt_ids: list[int],
        *,
        chat: bool,
        mender: StreamMender,
        max_tokens: int,
        max_wait: float,
        clock: Callable[[], float] = time.monotonic,
        logprob_tokenizer: Tokenizer | None = None,
    ) -> None:
        self._server = server
        self._request = request
        self.prompt_ids = prompt_ids
        self._chat = chat
        self._mender = mender
        self._max_tokens = max_tokens
        self._max_wait = max_wait
        self._clock = clock
        self._logprob_tokenizer = logprob_tokenizer  # fills in what the parsed path leaves out
        self._choices: dict[int, _Choice] = {}
        self._request_id = ""
        self.calls = 0  # derender calls made (the benchmark reads it)

    def due_in(self) -> float | None:
        """Seconds until waiting tokens must go out; ``None``: none wait."""
        oldest = [c.since for c in self._choices.values() if c.since is not None and c.ids]
        if not oldest:
            return None
        return max(0.0, min(oldest) + self._max_wait - self._clock())

    async def feed(self, chunk: dict[str, Any]) -> list[bytes]:
        self._request_id = str(chunk.get("request_id") or self._request_id)
        frames: list[bytes] = []
        for raw in chunk.get("choices") or ():
            if not isinstance(raw, dict):
                continue
            index = int(raw.get("index") or 0)
            choice = self._choices.setdefault(index, _Choice(index))
            ids = raw.get("token_ids") or []
            if ids and choice.since is None:
                choice.since = self._clock()
            choice.ids.extend(ids)
            logprobs = raw.get("logprobs")
            if isinstance(logprobs, dict):
                choice.has_logprobs = True
                choice.logprobs.extend(logprobs.get("content") or ())
            if raw.get("finish_reason") is not None:
                choice.finish_reason = raw["finish_reason"]
                choice.stop_reason = raw.get("stop_reason")
            if (
                not choice.sent_first
                or choice.finish_reason is not None
                or len(choice.ids) >= self._max_tokens
                or (choice.since is not None and self._clock() - choice.since >= self._max_wait)
            ):
                frames += await self._send(choice)
        usage = chunk.get("usage")
        if usage is not None and not chunk.get("choices"):
            frames += await self.flush()
            frames += await self._derender({"choices": [], "usage": usage}, None, {})
        return frames

    async def flush(self) -> list[bytes]:
        frames: list[bytes] = []
        for choice in self._choices.values():
            if choice.ids or choice.finish_reason is not None:
                frames += await self._send(choice)
        return frames

    async def _send(self, choice: _Choice) -> list[bytes]:
        if not choice.ids and choice.finish_reason is None:
            return []
        part: dict[str, Any] = {
            "index": choice.index,
            "finish_reason": choice.finish_reason,
            "stop_reason": choice.stop_reason,
            "token_ids": choice.ids,
            "logprobs": {"content": choice.logprobs} if choice.has_logprobs else None,
        }
        ids = choice.ids
        choice.ids, choice.logprobs, choice.since = [], [], None
        choice.sent_first = True
        done = choice.finish_reason is not None
        choice.finish_reason = None  # sent once
        frames = await self._derender(
            {"choices": [part], "usage": None}, choice, {choice.index: ids}, part["logprobs"]
        )
        if done:
            self._choices.pop(choice.index, None)
        return frames

    async def _derender(
        self,
        body: dict[str, Any],
        choice: _Choice | None,
        ids: dict[int, list[int]],
        logprobs: dict[str, Any] | None = None,
    ) -> list[bytes]:
        chunk = {"request_id": self._request_id, "output_mode": "tokens", **body}
        state = choice.state if choice is not None else None
        self.calls += 1
        out, new_state = await self._server.derender_chunk(
            chunk, state, self.prompt_ids, self._request, chat=self._chat
        )
        if choice is not None:
            choice.state = new_state
            if logprobs is not None and self._logprob_tokenizer is not None:
                for part in out.get("choices") or ():
                    if isinstance(part, dict) and part.get("logprobs") is None:
                        part["logprobs"] = resolve_logprobs(
                            logprobs["content"], self._logprob_tokenizer, choice.context
                        )
        mended = self._mender.mend(out, ids)
        if mended is None:
            return []
        return [b"data: " + _encoder.encode(mended) + b"\n\n"]


async def derendered_stream(
    first: bytes, events: AsyncIterator[bytes], coalescer: Coalescer, output: DecodeOutput
) -> AsyncGenerator[bytes, None]:
    """SSE frames for the client from D's generate stream (``first`` already read), until
    D's ``[DONE]``; waiting tokens go out when their time is up even if D is silent."""

    def parse(data: bytes) -> dict[str, Any]:
        obj = parse_chunk(data)
        output.collect(obj)
        return obj

    async def next_event() -> bytes | None:
        try:
            return await anext(events)
        except StopAsyncIteration:
            return None

    if first != b"[DONE]":
        for frame in await coalescer.feed(parse(first)):
            yield frame
    else:
        return
    pending: asyncio.Task[bytes | None] | None = None
    try:
        while True:
            if pending is None:
                pending = asyncio.ensure_future(next_event())
            due = coalescer.due_in()
            if due is not None:
                done, _ = await asyncio.wait({pending}, timeout=due)
                if not done:
                    for frame in await coalescer.flush():
                        yield frame
                    continue
            data = await pending
            pending = None
            if data is None or data == b"[DONE]":
                break
            for frame in await coalescer.feed(parse(data)):
                yield frame
        for frame in await coalescer.flush():
            yield frame
    finally:
        if pending is not None and not pending.done():
            pending.cancel()
