"""``carryover serve`` as a real subprocess on a free port."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import httpx

from tests.support.ports import free_port
from tests.support.secrets import assert_absent, group_environ


class RouterProcess:
    def __init__(
        self,
        args: Sequence[str],
        log_dir: Path,
        port: int | None = None,
        env: dict[str, str] | None = None,
        python: str = sys.executable,
    ) -> None:
        self.python = python
        self.port = port or free_port()
        self.env = env or {}
        self.args = [*args, "--port", str(self.port), "--expose-path-header"]
        self.log_path = log_dir / f"router-{self.port}.log"
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def launch(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "ab")  # noqa: SIM115 - owned by the process
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **self.env}
        # pytest names the running test here, parameters and all: not the router's business
        # (and a parameter can be a key, which the scan on stop would rightly find).
        env.pop("PYTEST_CURRENT_TEST", None)
        self.process = subprocess.Popen(
            [self.python, "-m", "carryover", "serve", *self.args],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,  # uvicorn's workers are children: signal the whole group
        )

    async def start(self, timeout: float = 180.0, *, ready: bool = True) -> None:
        """Launch and wait (without blocking the loop: in-process engines must answer probes)
        until ``/ready`` (or ``/health``) answers 200."""
        self.launch()
        assert self.process is not None
        probe = "/ready" if ready else "/health"
        deadline = time.monotonic() + timeout
        async with httpx.AsyncClient(timeout=0.5) as client:
            while time.monotonic() < deadline:
                if self.process.poll() is not None:
                    raise RuntimeError(f"router exited: {self.log_path.read_text()[-2000:]}")
                try:
                    if (await client.get(f"{self.url}{probe}")).status_code == 200:
                        return
                except httpx.HTTPError:
                    pass
                await asyncio.sleep(0.05)
        log = self.log_path.read_text()[-2000:]
        self.kill()
        raise RuntimeError(f"router did not start: {log}")

    def stop(self) -> None:
        """Graceful stop (SIGINT, as an operator would), then nothing of the group left; no
        registered secret was in any of its processes' environments or in its log."""
        if self.process is not None and self.process.poll() is None:
            for pid, environ in group_environ(self.process.pid).items():
                assert_absent(environ, f"the environment of router process {pid}")
            self.process.send_signal(signal.SIGINT)
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        self.kill()
        if self.log_path.exists():
            assert_absent(self.log_path.read_text(errors="replace"), f"{self.log_path}")

    def kill(self) -> None:
        """SIGKILL to the router and its workers."""
        if self.process is not None:
            try:
                os.killpg(self.process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.process.wait()
            self.process = None

    def log(self) -> str:
        return self.log_path.read_text()
