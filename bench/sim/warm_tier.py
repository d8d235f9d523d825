"""A simulated warm KV tier: what LMCache's server is to vLLM engines (docs/warm-tier.md).

Engines reach one ``SimWarmTier``: in the same process (``SimEngine.warm_tier``, the tests), or
over HTTP (``carryover sim-warm-tier``, and ``carryover sim … --sim-warm-tier URL``, the
benchmark). An engine that computed a prompt saves its whole chunks; an engine starting a
prompt without a handle loads the leading chunks the tier holds beyond its own prefix-cache
hit, and computes the rest. A chunk holds the KV *content* of its blocks as computed
(bench/sim/kv.py), keyed by the chain hash of its tokens, so an edited history misses instead of
loading wrong KV, as LMCache's token keys do. Loading costs ``Timing.warm_load``.

``GET /healthcheck`` answers 200 while the tier is up, 503 while ``up`` is false. A tier that is
down, or cannot be reached, is a miss for every lookup and drops every save: the engine
computes, no request fails (what vLLM does once LMCache's connector has given up on its
server).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import aiohttp
from aiohttp import web

from carryover.bench.sim.kv import token_hashes

__all__ = ["RemoteWarmTier", "SimWarmTier", "WarmTierClient"]


class WarmTierClient(Protocol):
    async def lookup(
        self, prompt: Sequence[int], limit_tokens: int, salt: str | None = None
    ) -> list[bytes]: ...

    async def save(
        self,
        prompt: Sequence[int],
        contents: Sequence[bytes],
        block_size: int,
        salt: str | None = None,
    ) -> None: ...


class SimWarmTier:
    def __init__(self, *, chunk_tokens: int = 256, host: str = "127.0.0.1", port: int = 0) -> None:
        self.chunk_tokens = chunk_tokens
        self.host = host
        self.port = port
        self.up = True
        #: chunk key -> the KV contents of its blocks, in order.
        self.chunks: dict[bytes, list[bytes]] = {}
        self.stored_tokens = 0
        self._runner: web.AppRunner | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def health(self) -> str:
        return f"{self.url}/healthcheck"

    async def start(self) -> None:
        app = web.Application(client_max_size=256 << 20)
        app.add_routes(
            [
                web.get("/healthcheck", self._healthcheck),
                web.get("/health", self._healthcheck),  # as every process of a topology
                web.post("/lookup", self._lookup),
                web.post("/save", self._save),
            ]
        )
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port)
        await site.start()
        if self.port == 0:
            self.port = self._runner.addresses[0][1]

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def _healthcheck(self, _: web.Request) -> web.Response:
        status = 200 if self.up else 503
        return web.json_response({"status": "ok" if self.up else "down"}, status=status)

    async def _lookup(self, request: web.Request) -> web.Response:
        body = await request.json()
        found = await self.lookup(body["tokens"], int(body["limit"]), body.get("salt"))
        return web.json_response({"contents": [c.hex() for c in found]})

    async def _save(self, request: web.Request) -> web.Response:
        body = await request.json()
        contents = [bytes.fromhex(c) for c in body["contents"]]
        await self.save(body["tokens"], contents, int(body["block_size"]), body.get("salt"))
        return web.Response(status=204)

    async def save(
        self,
        prompt: Sequence[int],
        contents: Sequence[bytes],
        block_size: int,
        salt: str | None = None,
    ) -> None:
        """The whole chunks of ``prompt`` whose blocks' contents are ``contents``, keyed under
        the request's ``salt`` (vLLM 0.33's LMCache connector passes ``cache_salt``)."""
        if not self.up:
            return
        per_chunk = self.chunk_tokens // block_size
        for index, key in enumerate(token_hashes(prompt, self.chunk_tokens, salt)):
            blocks = contents[index * per_chunk : (index + 1) * per_chunk]
            if key not in self.chunks and len(blocks) == per_chunk:
                self.chunks[key] = list(blocks)
                self.stored_tokens += self.chunk_tokens

    async def lookup(
        self, prompt: Sequence[int], limit_tokens: int, salt: str | None = None
    ) -> list[bytes]:
        """The contents of the prompt's leading blocks held here, in whole chunks of at most
        ``limit_tokens`` tokens in all (empty while down)."""
        if not self.up:
            return []
        found: list[bytes] = []
        for key in token_hashes(prompt[:limit_tokens], self.chunk_tokens, salt):
            chunk = self.chunks.get(key)
            if chunk is None:
                break
            found += chunk
        return found


class RemoteWarmTier:
    """A ``SimWarmTier`` in another process; unreachable is the same as down."""

    def __init__(self, url: str, *, timeout: float = 5.0) -> None:
        self.url = url.rstrip("/")
        self._timeout = aiohttp.ClientTimeout(total=timeout)
        self._session: aiohttp.ClientSession | None = None

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=self._timeout)
        return self._session

    async def lookup(
        self, prompt: Sequence[int], limit_tokens: int, salt: str | None = None
    ) -> list[bytes]:
        body = {"tokens": list(prompt), "limit": limit_tokens, "salt": salt}
        try:
            async with self._client().post(f"{self.url}/lookup", json=body) as response:
                if response.status != 200:
                    return []
                found = await response.json()
        except (aiohttp.ClientError, TimeoutError):
            return []
        return [bytes.fromhex(c) for c in found["contents"]]

    async def save(
        self,
        prompt: Sequence[int],
        contents: Sequence[bytes],
        block_size: int,
        salt: str | None = None,
    ) -> None:
        body = {
            "tokens": list(prompt),
            "contents": [c.hex() for c in contents],
            "block_size": block_size,
            "salt": salt,
        }
        try:
            async with self._client().post(f"{self.url}/save", json=body):
                pass
        except (aiohttp.ClientError, TimeoutError):
            return

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None
