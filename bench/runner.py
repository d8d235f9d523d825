"""Drive multi-turn conversations against an OpenAI-compatible endpoint and time every turn."""

from __future__ import annotations

import asyncio
import gc
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import msgspec

from carryover.bench.workload import Conversation
from carryover.router.loop_lag import watch_loop_lag

__all__ = ["TurnRecord", "one_turn", "run_arm"]

_decode = msgspec.json.Decoder()
_encode = msgspec.json.Encoder()
_JSON = {"content-type": "application/json"}


@dataclass
class TurnRecord:
    arm: str
    conversation: str
    turn: int  # 1-based
    status: int
    ttft: float | None  # seconds to the first generated text
    itl: list[float] = field(default_factory=list)
    e2e: float = 0.0
    path: str | None = None
    answer: str = ""
    error: str | None = None
    prompt_tokens: int | None = None  # the answer's usage, as the client is told


class _Progress:
    def __init__(self, label: str, total: int, enabled: bool) -> None:
        self.label, self.total, self.done, self.enabled = label, total, 0, enabled

    def step(self) -> None:
        self.done += 1
        if self.enabled:
            width = 30
            filled = int(width * self.done / max(self.total, 1))
            bar = "#" * filled + "." * (width - filled)
            sys.stderr.write(f"\r  {self.label:<22} [{bar}] {self.done}/{self.total}")
            if self.done == self.total:
                sys.stderr.write("\n")
            sys.stderr.flush()


async def one_turn(
    client: httpx.AsyncClient,
    url: str,
    arm: str,
    conversation: Conversation,
    turn: int,
    messages: list[dict[str, Any]],
    model: str,
    send_conversation_id: bool,
    session_header: bool = False,
) -> TurnRecord:
    body: dict[str, Any] = {
        "model": model,
        "messages": messages,
        "max_tokens": conversation.output_tokens[turn],
        "ignore_eos": True,
        "temperature": 0,
        "stream": conversation.stream,
    }
    if conversation.stream:
        body["stream_options"] = {"include_usage": True}
    if conversation.thinking:
        body["chat_template_kwargs"] = {"enable_thinking": True}
    if send_conversation_id:
        body["conversation_id"] = conversation.id
    record = TurnRecord(arm, conversation.id, turn + 1, 0, None)
    started = time.perf_counter()
    last = None
    try:
        # What session-affine routers key on (vLLM Router's consistent_hash reads X-Session-ID).
        headers = {**_JSON, "X-Session-ID": conversation.id} if session_header else _JSON
        # Encoded here, and the stream split into lines here, rather than by httpx (the
        # standard library's json, a text decoder and a line decoder in Python): the client's
        # own work delays the chunks it times.
        content = _encode.encode(body)
        if not conversation.stream:
            await _whole(client, f"{url}/v1/chat/completions", content, headers, record)
            record.e2e = time.perf_counter() - started
            return record
        async with client.stream(
            "POST", f"{url}/v1/chat/completions", content=content, headers=headers
        ) as response:
            record.status = response.status_code
            record.path = response.headers.get("x-carryover-path")
            if response.status_code != 200:
                record.error = (await response.aread()).decode(errors="replace")[:300]
                return record
            async for line in _sse_data(response):
                if line == b"[DONE]":
                    continue
                chunk = _decode.decode(line)
                if "error" in chunk:
                    record.error = str(chunk["error"])
                    continue
                if chunk.get("usage"):
                    record.prompt_tokens = chunk["usage"].get("prompt_tokens")
                for choice in chunk.get("choices", []):
                    delta = choice.get("delta", {})
                    text = delta.get("content") or ""
                    if text or delta.get("reasoning_content"):
                        now = time.perf_counter()
                        if record.ttft is None:
                            record.ttft = now - started
                        elif last is not None:
                            record.itl.append(now - last)
                        last = now
                    record.answer += text
    except httpx.HTTPError as exc:
        record.error = f"{type(exc).__name__}: {exc}"
    record.e2e = time.perf_counter() - started
    return record


async def _sse_data(response: httpx.Response) -> AsyncIterator[bytes]:
    """The ``data:`` payloads of an SSE body, as they arrive."""
    pending = b""
    async for data in response.aiter_raw():
        *lines, pending = (pending + data).split(b"\n")
        for line in lines:
            if line.startswith(b"data:"):
                yield line[5:].strip()
    if pending.startswith(b"data:"):
        yield pending[5:].strip()


async def _whole(
    client: httpx.AsyncClient,
    url: str,
    content: bytes,
    headers: dict[str, str],
    record: TurnRecord,
) -> None:
    """A turn answered whole: its time to first token is the time to the whole answer."""
    started = time.perf_counter()
    try:
        response = await client.post(url, content=content, headers=headers)
    except httpx.HTTPError as exc:
        record.error = f"{type(exc).__name__}: {exc}"
        return
    record.status = response.status_code
    record.path = response.headers.get("x-carryover-path")
    if response.status_code != 200:
        record.error = response.text[:300]
        return
    answer = _decode.decode(response.content)
    record.ttft = time.perf_counter() - started
    record.answer = answer["choices"][0]["message"].get("content") or ""
    record.prompt_tokens = (answer.get("usage") or {}).get("prompt_tokens")


async def run_arm(
    arm: str,
    url: str,
    conversations: list[Conversation],
    *,
    model: str,
    send_conversation_id: bool = True,
    session_header: bool = False,
    progress: bool = True,
    timeout: float = 600.0,
    loop_lag: list[float] | None = None,
    collections: dict[str, list[float]] | None = None,
) -> list[TurnRecord]:
    """Every conversation's turns against ``url``. ``loop_lag``, when given, receives how late
    the load generator's own event loop ran a timer set every 20 ms, through the arm: a
    client that lags adds its lag to every turn it times; ``collections``, the length of
    each of its garbage collector's passes, by generation (one cause of such lag)."""
    total = sum(len(c.users) for c in conversations)
    bar = _Progress(arm, total, progress)
    limits = httpx.Limits(max_connections=1024, max_keepalive_connections=1024)
    records: list[TurnRecord] = []
    async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:
        # What the process does once, on its first request (anyio's backend and the HTTP
        # stack import lazily: tens of ms), done before the arm's clock: it stalled the loop
        # among the first turns of whichever arm ran first.
        await client.get(f"{url}/health")

        async def converse(conversation: Conversation) -> None:
            await asyncio.sleep(conversation.start_after)
            users = list(conversation.users)
            messages: list[dict[str, Any]] = []
            if conversation.system:
                messages.append({"role": "system", "content": conversation.system})
            for turn, text in enumerate(users):
                edited = conversation.edits.get(turn)
                if edited is not None:
                    # A client rewriting an earlier message: the history no longer matches.
                    position = [i for i, m in enumerate(messages) if m["role"] == "user"][edited]
                    messages[position] = {
                        "role": "user",
                        "content": "(edited) " + messages[position]["content"],
                    }
                role = "tool" if conversation.tool_results and turn > 0 else "user"
                messages.append({"role": role, "content": text})
                record = await one_turn(
                    client,
                    url,
                    arm,
                    conversation,
                    turn,
                    messages,
                    model,
                    send_conversation_id,
                    session_header,
                )
                records.append(record)
                bar.step()
                if record.error is not None:
                    for _ in range(turn + 1, len(users)):
                        bar.step()
                    return
                messages.append({"role": "assistant", "content": record.answer})
                if conversation.think_ms[turn]:
                    await asyncio.sleep(conversation.think_ms[turn] / 1000)

        watching = (
            asyncio.create_task(
                watch_loop_lag(
                    _Appends(loop_lag),
                    interval=0.02,
                    collections=_ByGeneration(collections) if collections is not None else None,
                )
            )
            if loop_lag is not None
            else None
        )
        gc.collect()
        gc.freeze()  # what was there before the arm: never walked again while it runs
        freezing = asyncio.create_task(_keep_heap_frozen())
        try:
            await asyncio.gather(*(converse(c) for c in conversations))
        finally:
            freezing.cancel()
            if watching is not None:
                watching.cancel()
    gc.unfreeze()
    gc.collect()
    return records


async def _keep_heap_frozen(every: float = 1.0) -> None:
    """Every second, what the load generator holds leaves its collector's sight: its full
    passes walked every conversation's messages and record (up to 160 ms a pass at 500
    conversations), a pause that lands in the ITL of every stream it times. Cycles that
    became garbage meanwhile wait for the end of the arm (``run_arm`` collects them)."""
    while True:
        await asyncio.sleep(every)
        gc.freeze()


class _Appends:
    """The loop-lag watcher's observer for a plain list."""

    def __init__(self, into: list[float]) -> None:
        self.observe = into.append


class _ByGeneration:
    """The loop-lag watcher's observer of collector passes, a list per generation."""

    def __init__(self, into: dict[str, list[float]]) -> None:
        self._into = into

    def labels(self, generation: str) -> _Appends:
        return _Appends(self._into.setdefault(generation, []))
