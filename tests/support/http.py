"""An HTTP client for tests that talk to servers closing idle connections on their own clock."""

from __future__ import annotations

import httpx


class ResendStaleGets(httpx.AsyncHTTPTransport):
    """Sends a GET once more on a fresh connection when the server closed the pooled one it
    went out on without answering.

    A keep-alive expiry below the server's idle close makes that race rare, not impossible: a
    run on two loaded cores still met it once on a ``/metrics`` scrape of a vLLM engine. A GET
    changes nothing on the server, so sending it again is what browsers do too; other methods
    still fail loudly.
    """

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        try:
            return await super().handle_async_request(request)
        except httpx.RemoteProtocolError:
            if request.method != "GET":
                raise
            return await super().handle_async_request(request)
