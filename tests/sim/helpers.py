from __future__ import annotations

from typing import Any

import httpx

from carryover.bench.sim.server import SimServer
from tests.support.sims import MODEL

LONG = (
    "Please describe, in plain words and with care, how a river shapes the stones in a garden "
    "over many years, and what a careful gardener would do about it in each season. "
)


def user(text: str) -> dict[str, str]:
    return {"role": "user", "content": text}


def chat_body(messages: list[dict[str, Any]], max_tokens: int = 40, **extra: Any) -> dict[str, Any]:
    return {
        "model": MODEL,
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0,
        "return_token_ids": True,
        **extra,
    }


async def post(
    client: httpx.AsyncClient, server: SimServer, path: str, body: dict[str, Any]
) -> httpx.Response:
    return await client.post(server.url + path, json=body)


async def tokenize(
    client: httpx.AsyncClient, server: SimServer, messages: list[dict[str, Any]], **extra: Any
) -> list[int]:
    r = await post(client, server, "/tokenize", {"model": MODEL, "messages": messages, **extra})
    r.raise_for_status()
    tokens: list[int] = r.json()["tokens"]
    return tokens


async def pd_chat(
    client: httpx.AsyncClient,
    p: SimServer,
    d: SimServer,
    body: dict[str, Any],
    handle: dict[str, Any] | None = None,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """One P/D turn as a router runs it; returns (D's body, P's body)."""
    p_body = {
        **body,
        "max_tokens": 1,
        "stream": False,
        "kv_transfer_params": handle if handle is not None else {"do_remote_decode": True},
    }
    rp = await post(client, p, "/v1/chat/completions", p_body)
    rp.raise_for_status()
    p_json = rp.json()
    rd = await post(
        client,
        d,
        "/v1/chat/completions",
        {**body, "kv_transfer_params": p_json["kv_transfer_params"]},
    )
    rd.raise_for_status()
    return rd.json(), p_json


def output_ids(body: dict[str, Any]) -> list[int]:
    ids: list[int] = body["choices"][0]["token_ids"]
    return ids


async def reference(
    client: httpx.AsyncClient, server: SimServer, body: dict[str, Any]
) -> list[int]:
    """The same request on one instance, no kv params, with a fresh cache salt."""
    r = await post(client, server, "/v1/chat/completions", body)
    r.raise_for_status()
    return output_ids(r.json())
