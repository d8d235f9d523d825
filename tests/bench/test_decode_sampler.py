"""The decoders' KV sampler runs inside the load generator's process: what it costs there is
taken from the turns being timed (bench/fleet_counters.py)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from carryover.bench.fleet_counters import DecodeSampler

PAGE = b"""# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0"} 0.25
# TYPE sim:pinned_handles gauge
sim:pinned_handles 3.0
# TYPE sim:pinned_kv_usage_perc gauge
sim:pinned_kv_usage_perc 0.125
"""


class _Metrics(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def do_GET(self) -> None:
        self.send_response(200)
        self.send_header("Content-Length", str(len(PAGE)))
        self.end_headers()
        self.wfile.write(PAGE)

    def log_message(self, *_: object) -> None:
        return


@pytest.fixture
def decoders() -> Iterator[list[str]]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Metrics)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield [f"http://127.0.0.1:{server.server_address[1]}"] * 4
    finally:
        server.shutdown()
        server.server_close()


def test_a_sample_of_four_decoders_reads_their_gauges_for_little_cpu(decoders: list[str]) -> None:
    sampler = DecodeSampler(decoders, interval=3600)
    sampler._sample()  # connections open
    started = time.thread_time()
    for _ in range(10):
        sampler._sample()
    spent = (time.thread_time() - started) / 10
    sampler._client.close()
    assert sampler.samples[-1][1:] == (0.25, 12.0, 0.125)  # mean use, pins summed, mean share
    # A client per scrape built an SSL context each time: about 50 ms of CPU a scrape.
    assert spent < 0.04, f"{spent * 1000:.1f} ms of CPU a sample"
