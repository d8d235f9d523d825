"""An HTTP client for tests that talk to servers closing idle connections on their own clock."""

from __future__ import annotations

import httpx

#: A request extension by which a test says that its request, sent twice, changes nothing
#: more than sent once (``client.post(url, extensions=SAFE_TO_RESEND)``).
_SAFE_KEY = "carryover_safe_to_resend"
SAFE_TO_RESEND = {_SAFE_KEY: True}


class ResendStaleGets(httpx.AsyncHTTPTransport):
    """Sends a GET (or a request marked ``SAFE_TO_RESEND``) once more on a fresh connection
    when the server closed (FIN) or reset (RST) the pooled one it went out on without
    answering.

    A keep-alive expiry below the server's idle close makes that race rare, not impossible: a
    run on two loaded cores still met it once on a ``/metrics`` scrape of a vLLM engine, once
    on a POST of vLLM's ``/reset_prefix_cache`` and once, as a reset, on a POST to vLLM's
    render server. A GET changes nothing on the server, so sending it again is what browsers
    do too; other methods fail loudly unless marked.
    """

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        try:
            return await super().handle_async_request(request)
        except (httpx.RemoteProtocolError, httpx.ReadError):
            if request.method != "GET" and not request.extensions.get(_SAFE_KEY):
                raise
            return await super().handle_async_request(request)
