"""Start a throwaway redis-server on a free loopback port (benchmarks and the demo)."""

from __future__ import annotations

import contextlib
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator

from carryover.bench.ports import free_port
from carryover.bench.redis_server import KEEP_ENVIRONMENT


@contextlib.contextmanager
def local_redis() -> Iterator[str]:
    """Yield the URL of a fresh redis-server that is stopped on exit."""
    binary = shutil.which("redis-server")
    if binary is None:
        raise RuntimeError("redis-server is not installed (apt-get install redis-server)")
    port = free_port()
    with tempfile.TemporaryDirectory() as workdir:
        args = [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", ""]
        args += [f"--{KEEP_ENVIRONMENT[0]}", KEEP_ENVIRONMENT[1]]
        proc = subprocess.Popen(
            [*args, "--appendonly", "no", "--dir", workdir],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            deadline = time.monotonic() + 10
            while True:
                try:
                    socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                    break
                except OSError:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.02)
            yield f"redis://127.0.0.1:{port}/0"
        finally:
            proc.kill()
            proc.wait()
