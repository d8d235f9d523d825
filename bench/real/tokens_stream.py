"""What a streamed answer costs in each way of running vLLM's parsers, on real engines (the
CPU build, the seeded tiny Qwen3): CPU per streamed token of every process outside the model
itself, inter-token latency and time to first token, as the client sees them.

Arms (one engine at a time, no P/D: the parsers' cost is the question, not the transfer):

- ``vllm-serve``: ``vllm serve`` with the reasoning and tool parsers, streamed
  ``/v1/chat/completions``: parsing inside the engine's API server.
- ``per-chunk-derender``: a ``--tokens-only`` engine and a render server with the same
  parsers, driven the way vLLM documents it: render, stream generate, one streaming derender
  call per chunk (the whole prompt, request and state each time).
- ``carryover``: the same engine and render server behind ``carryover serve --engine-api
  tokens`` (derender batched, ``--stream-tokens``).

CPU counted: the engine's API server process (not its engine core, which runs the model), the
render server, the router's process tree, and the driving client's own CPU for the per-chunk
arm (that loop is the application doing the derendering). The client and all servers share
the machine's cores.

    python -m carryover.bench.real.tokens_stream --requests 8 --max-tokens 128 --out DIR
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from carryover.bench.ports import free_port
from carryover.bench.proctree import cpu_seconds
from carryover.bench.real.launch import SERVED_NAME, single_engine
from carryover.bench.real.process import spawn, stop_group
from carryover.bench.real.render import RenderServerProcess

__all__ = ["main"]

PARSERS = ["--reasoning-parser", "qwen3", "--tool-call-parser", "hermes"]


def _own_cpu(pid: int) -> float:
    """User and system CPU of one process, without its children."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@contextmanager
def _router(log: Path, decode: str, render: str, stream_tokens: int) -> Iterator[tuple[str, int]]:
    port = free_port()
    args = [
        sys.executable,
        "-m",
        "carryover",
        "serve",
        "--port",
        str(port),
        "--decode",
        decode,
        "--engine-api",
        "tokens",
        "--render",
        render,
        "--render-timeout",
        "60",
        "--stream-tokens",
        str(stream_tokens),
        "--first-byte-timeout",
        "300",
        *PARSERS,
    ]
    popen = spawn(args, log, dict(os.environ))
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        # Ready means the render server was checked; /ready also wants a P, and this arm has
        # none (D serves alone), so a turn that answers is the sign.
        probe = {**_request(-1, 1), "max_tokens": 1}
        while True:
            try:
                answer = httpx.post(url + "/v1/chat/completions", json=probe, timeout=60)
                if answer.status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if popen.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"router did not get ready:\n{log.read_text()[-2000:]}")
            time.sleep(0.2)
        yield url, popen.pid
    finally:
        stop_group(popen, timeout=60)


def _request(nonce: int, max_tokens: int) -> dict[str, Any]:
    return {
        "model": SERVED_NAME,
        "messages": [{"role": "user", "content": f"request {nonce}: tell me a long story"}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
    }


@dataclass
class _Stream:
    ttft: float = 0.0
    gaps: list[float] = field(default_factory=list)  # between chunks that carried text
    tokens_per_chunk: list[int] = field(default_factory=list)


def _text_of(chunk: dict[str, Any]) -> str:
    out = ""
    for choice in chunk.get("choices") or ():
        delta = choice.get("delta") or {}
        out += (delta.get("content") or "") + (delta.get("reasoning") or "")
        for call in delta.get("tool_calls") or ():
            out += (call.get("function") or {}).get("arguments") or ""
    return out


def _timed_chunks(
    lines: Iterator[str], started: float, stream: _Stream
) -> Iterator[dict[str, Any]]:
    last = None
    for line in lines:
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        chunk = json.loads(line[6:])
        yield chunk
        if _text_of(chunk):
            now = time.perf_counter()
            if last is None:
                stream.ttft = now - started
            else:
                stream.gaps.append(now - last)
            last = now


def _openai_stream(client: httpx.Client, url: str, body: dict[str, Any]) -> _Stream:
    stream = _Stream()
    started = time.perf_counter()
    with client.stream("POST", url + "/v1/chat/completions", json={**body, "stream": True}) as r:
        r.raise_for_status()
        for _ in _timed_chunks(r.iter_lines(), started, stream):
            pass
    return stream


def _per_chunk_stream(
    client: httpx.Client, engine: str, render: str, body: dict[str, Any]
) -> _Stream:
    stream = _Stream()
    started = time.perf_counter()
    generate = client.post(render + "/v1/chat/completions/render", json=body).json()
    generate["sampling_params"]["max_tokens"] = body["max_tokens"]
    generate["stream"] = True
    state = None
    last = None
    with client.stream("POST", engine + "/inference/v1/generate", json=generate) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            call = {
                "stream": True,
                "generate_chunk": json.loads(line[6:]),
                "stream_state": state,
                "prompt_token_ids": generate["token_ids"],
                "chat_request": body,
            }
            out = client.post(render + "/v1/chat/completions/derender", json=call).json()
            state = out["stream_state"]
            if _text_of(out["chunk"]):
                now = time.perf_counter()
                if last is None:
                    stream.ttft = now - started
                else:
                    stream.gaps.append(now - last)
                last = now
    return stream


def _summary(streams: list[_Stream], cpu: dict[str, float], tokens: int) -> dict[str, Any]:
    gaps = [g for s in streams for g in s.gaps]
    return {
        "requests": len(streams),
        "tokens": tokens,
        "ttft_ms_p50": 1000 * statistics.median(s.ttft for s in streams),
        "chunk_gap_ms_p50": 1000 * statistics.median(gaps) if gaps else None,
        "ms_per_token_p50": 1000
        * statistics.median((sum(s.gaps) / max(1, tokens // len(streams) - 1)) for s in streams),
        "cpu_ms_per_token": {name: 1000 * seconds / tokens for name, seconds in cpu.items()},
        "cpu_ms_per_token_total": 1000 * sum(cpu.values()) / tokens,
    }


def run(requests: int, max_tokens: int, stream_tokens: int, out: Path) -> dict[str, Any]:
    out.mkdir(parents=True, exist_ok=True)
    tokens = requests * max_tokens
    results: dict[str, Any] = {"requests": requests, "max_tokens": max_tokens}
    client = httpx.Client(timeout=600)
    bodies = [_request(i, max_tokens) for i in range(requests)]
    with single_engine(out / "vllm-serve.log", *PARSERS, "--enable-auto-tool-choice") as (url, pid):
        _openai_stream(client, url, _request(-1, 4))  # first use: warm-up
        before = _own_cpu(pid)
        streams = [_openai_stream(client, url, body) for body in bodies]
        results["vllm-serve"] = _summary(streams, {"engine_api": _own_cpu(pid) - before}, tokens)
    render = RenderServerProcess(
        out / "render.log", parsers=[*PARSERS, "--enable-auto-tool-choice"]
    )
    render.start()
    assert render.popen is not None
    try:
        with single_engine(out / "tokens-engine.log", "--tokens-only") as (engine, pid):
            _per_chunk_stream(client, engine, render.url, _request(-1, 4))
            cpu0 = (_own_cpu(pid), cpu_seconds(render.popen.pid), time.process_time())
            streams = [_per_chunk_stream(client, engine, render.url, body) for body in bodies]
            cpu = {
                "engine_api": _own_cpu(pid) - cpu0[0],
                "render_server": cpu_seconds(render.popen.pid) - cpu0[1],
                "client": time.process_time() - cpu0[2],
            }
            results["per-chunk-derender"] = _summary(streams, cpu, tokens)
            with _router(out / "router.log", engine, render.url, stream_tokens) as (router, rpid):
                _openai_stream(client, router, _request(-1, 4))
                cpu0 = (_own_cpu(pid), cpu_seconds(render.popen.pid), cpu_seconds(rpid))
                streams = [_openai_stream(client, router, body) for body in bodies]
                cpu = {
                    "engine_api": _own_cpu(pid) - cpu0[0],
                    "render_server": cpu_seconds(render.popen.pid) - cpu0[1],
                    "router": cpu_seconds(rpid) - cpu0[2],
                }
                results["carryover"] = _summary(streams, cpu, tokens)
    finally:
        render.stop()
    (out / "tokens_stream.json").write_text(json.dumps(results, indent=2))
    return results


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m carryover.bench.real.tokens_stream")
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--stream-tokens", type=int, default=8)
    parser.add_argument("--out", type=Path, default=Path("tokens-stream"))
    args = parser.parse_args(argv)
    results = run(args.requests, args.max_tokens, args.stream_tokens, args.out)
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
