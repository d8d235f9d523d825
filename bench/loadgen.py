"""A closed-loop client: a fixed number of workers, each sending its next request as soon as
the last one finished, the way vLLM's and sglang's routers measure their overhead."""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass
from typing import Any

import aiohttp

__all__ = ["Job", "Sample", "closed_loop"]


@dataclass(frozen=True)
class Job:
    """One request, or one conversation: each follow-up turn sends the request again with the
    answer and the next user message appended (chat requests, not streamed)."""

    path: str
    body: dict[str, Any]
    follow_ups: tuple[str, ...] = ()


@dataclass(frozen=True)
class Sample:
    latency: float  #: seconds until the whole answer was read
    first_chunk: float  #: seconds until the first SSE event (the latency when not streamed)


async def _one(session: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> bytes:
    """Send one request; the body read."""
    async with session.post(url, json=body) as response:
        if response.status != 200:
            raise RuntimeError(f"{url} answered {response.status}: {await response.text()}")
        return await response.read()


async def _streamed(
    session: aiohttp.ClientSession, url: str, body: dict[str, Any], started: float
) -> Sample:
    first = None
    async with session.post(url, json=body) as response:
        if response.status != 200:
            raise RuntimeError(f"{url} answered {response.status}: {await response.text()}")
        async for line in response.content:
            if first is None and line.startswith(b"data:"):
                first = time.perf_counter() - started
    latency = time.perf_counter() - started
    return Sample(latency, latency if first is None else first)


async def _run(session: aiohttp.ClientSession, base_url: str, job: Job, out: list[Sample]) -> None:
    url = base_url + job.path
    body = job.body
    for turn in range(len(job.follow_ups) + 1):
        started = time.perf_counter()
        if body.get("stream"):
            out.append(await _streamed(session, url, body, started))
            continue
        content = await _one(session, url, body)
        latency = time.perf_counter() - started
        out.append(Sample(latency, latency))
        if turn < len(job.follow_ups):
            answer = json.loads(content)["choices"][0]["message"]["content"]
            messages = [
                *body["messages"],
                {"role": "assistant", "content": answer},
                {"role": "user", "content": job.follow_ups[turn]},
            ]
            body = {**body, "messages": messages}


async def closed_loop(
    base_url: str, jobs: list[Job], concurrency: int
) -> tuple[list[Sample], float]:
    """Run every job with ``concurrency`` workers; the samples and the wall time."""
    queue = list(reversed(jobs))
    samples: list[Sample] = []
    connector = aiohttp.TCPConnector(limit=concurrency * 2)
    timeout = aiohttp.ClientTimeout(total=60)  # a router that hangs fails the run, soon
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:

        async def worker() -> None:
            while queue:
                await _run(session, base_url, queue.pop(), samples)

        started = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return samples, time.perf_counter() - started
