"""A live router in front of simulated engines (subprocesses), shared by the fuzz suites."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from carryover.bench.procs import Process, Topology


@pytest.fixture(scope="module")
def router(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Process]:
    topo = Topology(tmp_path_factory.mktemp("logs"))
    try:
        p = topo.sim("prefill", "kv_producer", speed=0, extra=["--max-model-len", "4096"])
        d = topo.sim("decode", "kv_consumer", speed=0, extra=["--max-model-len", "4096"])
        r = topo.router("router", [p], [d], "--max-messages", "64", "--max-body-bytes", "262144")
        topo.wait()
        yield r
    finally:
        topo.stop()
