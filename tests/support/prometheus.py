"""A real Prometheus server (Debian's ``prometheus``) scraping the test's routers every second,
on a free loopback port, with its data in the test's directory."""

from __future__ import annotations

import asyncio
import shutil
import subprocess
from collections.abc import AsyncIterator, Iterable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx

from tests.support.ports import free_port
from tests.support.waiting import eventually

__all__ = ["Prometheus", "prometheus"]


class Prometheus:
    def __init__(self, url: str, client: httpx.AsyncClient) -> None:
        self.url = url
        self.client = client

    async def query(self, expr: str) -> list[dict[str, Any]]:
        """An instant query's vector; a refused query fails the test with Prometheus' words."""
        response = await self.client.get(f"{self.url}/api/v1/query", params={"query": expr})
        answer = response.json()
        assert answer["status"] == "success", (expr, answer)
        result: list[dict[str, Any]] = answer["data"]["result"]
        return result

    async def value(self, expr: str) -> float | None:
        """A query whose answer is one number (None while it has no series)."""
        result = await self.query(expr)
        return float(result[0]["value"][1]) if result else None

    async def scraped(self, expr: str, want: float, *, what: str) -> None:
        """Wait until ``expr`` reads ``want``: Prometheus has scraped what the test sent."""

        async def read() -> float | None:
            return await self.value(expr)

        await eventually(read, lambda got: got == want, what=what, timeout=60)


def _start(workdir: Path, targets: list[str]) -> tuple[subprocess.Popen[bytes], int]:
    binary = shutil.which("prometheus")
    if binary is None:
        raise RuntimeError("prometheus is not installed (apt-get install prometheus)")
    workdir.mkdir(parents=True, exist_ok=True)
    config = workdir / "prometheus.yml"
    config.write_text(
        "global: {scrape_interval: 1s, evaluation_interval: 1s}\n"
        "scrape_configs:\n"
        f"  - job_name: carryover\n    static_configs: [{{targets: {targets}}}]\n"
    )
    port = free_port()
    with open(workdir / "prometheus.log", "ab") as log:
        process = subprocess.Popen(
            [
                binary,
                f"--config.file={config}",
                f"--storage.tsdb.path={workdir / 'data'}",
                f"--web.listen-address=127.0.0.1:{port}",
                "--log.level=warn",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    return process, port


@asynccontextmanager
async def prometheus(
    workdir: Path, routers: Iterable[str], client: httpx.AsyncClient
) -> AsyncIterator[Prometheus]:
    """Prometheus scraping ``routers`` (base URLs) as the job ``carryover``, every second;
    yields once it has scraped each of them at least once."""
    targets = [urlsplit(url).netloc for url in routers]
    process, port = await asyncio.to_thread(_start, workdir, targets)
    try:
        server = Prometheus(f"http://127.0.0.1:{port}", client)

        async def ready() -> bool:
            assert process.poll() is None, f"prometheus exited, see {workdir / 'prometheus.log'}"
            try:
                return (await client.get(f"{server.url}/-/ready")).status_code == 200
            except httpx.TransportError:
                return False

        await eventually(ready, what="Prometheus answers", timeout=60)
        await server.scraped(
            'count(up{job="carryover"} == 1)', len(targets), what="every router scraped"
        )
        yield server
    finally:
        await asyncio.to_thread(_stop, process)


def _stop(process: subprocess.Popen[bytes]) -> None:
    process.terminate()
    try:
        process.wait(timeout=10)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
