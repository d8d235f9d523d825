"""What an arm of the fleet benchmark does before its clock starts: the load generator's
first request, the decoders' first KV sample and a carryover router's render check are one-time
costs, and paid among the first turns they made the first arm of every run the slowest."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from carryover.bench.fleet_counters import DecodeSampler, wait_rendering
from carryover.bench.runner import run_arm
from carryover.bench.workload import Conversation


class _Recorder(BaseHTTPRequestHandler):
    """Answers every request; records the request lines in order. ``/metrics`` shows the
    render check pending for the first ``pending_reads`` reads."""

    protocol_version = "HTTP/1.1"
    seen: list[str]
    pending_reads: int

    def _answer(self, status: int, body: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:
        self.seen.append(f"GET {self.path}")
        if self.path != "/metrics":
            self._answer(200, b"{}")
            return
        type(self).pending_reads -= 1
        pending = 1.0 if self.pending_reads >= 0 else 0.0
        page = (
            f'carryover_render_check{{model="m",state="pending"}} {pending}\n'
            f'carryover_render_check{{model="m",state="agrees"}} {1.0 - pending}\n'
            'vllm:kv_cache_usage_perc{engine="0"} 0.5\n'
        )
        self._answer(200, page.encode())

    def do_POST(self) -> None:
        self.seen.append(f"POST {self.path}")
        self.rfile.read(int(self.headers["Content-Length"]))
        self._answer(503, b'{"error": {"message": "no", "type": "x", "code": 503}}')

    def log_message(self, *_: object) -> None:
        return


@pytest.fixture
def server() -> Iterator[tuple[str, type[_Recorder]]]:
    handler = type("Handler", (_Recorder,), {"seen": [], "pending_reads": 0})
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}", handler
    finally:
        httpd.shutdown()
        httpd.server_close()


def test_the_load_generator_sends_one_request_before_the_first_turn(
    server: tuple[str, type[_Recorder]],
) -> None:
    url, handler = server
    conversation = Conversation("c", None, ["hello"], [4], [0])
    records = asyncio.run(run_arm("arm", url, [conversation], model="m", progress=False))
    assert [r.status for r in records] == [503]
    assert handler.seen == ["GET /health", "POST /v1/chat/completions"]


def test_the_decoders_are_sampled_once_before_the_arm_starts(
    server: tuple[str, type[_Recorder]],
) -> None:
    url, handler = server
    with DecodeSampler([url], interval=3600) as sampler:
        assert len(sampler.samples) == 1  # taken on entering, not by the thread meanwhile
        assert sampler.samples[0][1] == 0.5
    assert handler.seen == ["GET /metrics", "GET /metrics"]  # and one as the run left them


def test_a_carryover_arm_waits_until_its_router_renders_in_process(
    server: tuple[str, type[_Recorder]],
) -> None:
    url, handler = server
    handler.pending_reads = 3
    wait_rendering(url, timeout=10)
    assert handler.seen.count("GET /metrics") == 4  # pending three times, then agrees
    handler.pending_reads = 10_000
    with pytest.raises(RuntimeError, match="still renders through P"):
        wait_rendering(url, timeout=0.3)
