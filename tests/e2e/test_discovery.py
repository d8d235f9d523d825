"""A decode instance found through the system resolver: ``dns://localhost:PORT`` is every
address localhost resolves to; the one where D listens joins at its first healthy probe and
serves a conversation whose second turn reuses its KV (docs/discovery.md)."""

from __future__ import annotations

import asyncio
import socket
from pathlib import Path
from urllib.parse import urlsplit

import httpx

from tests.support.metrics import ascrape
from tests.support.router_proc import RouterProcess
from tests.support.sims import running, sim_config
from tests.support.stack import chat_turn


async def test_a_decode_instance_found_by_its_name_serves_and_reuses(tmp_path: Path) -> None:
    async with (
        running(sim_config("kv_producer")) as prefill,
        running(sim_config("kv_consumer")) as decode,
    ):
        port = urlsplit(decode.url).port
        router = RouterProcess(
            ["--prefill", prefill.url, "--decode", f"dns://localhost:{port}"], tmp_path
        )
        await router.start()
        try:
            async with httpx.AsyncClient(timeout=30) as client:
                metrics = await ascrape(client, router.url)
                found = {
                    key: value
                    for key, value in metrics.items()
                    if key.startswith("carryover_instance_up{") and "role=decode" in key
                }
                # localhost may also resolve to ::1, where nothing listens: never joined.
                addresses = {info[4][0] for info in socket.getaddrinfo("localhost", port)}
                assert len(found) == len(addresses), (found, addresses)
                assert found[f"carryover_instance_up{{role=decode,server=127.0.0.1:{port}}}"] == 1
                assert (
                    metrics["carryover_instances_discovered_total{change=joined,role=decode}"] == 1
                )
                messages = [{"role": "user", "content": "Tell me about rivers. " * 20}]
                first = await chat_turn(client, router.url, messages, conversation_id="dns-1")
                assert first.status == 200 and first.path == "cold-miss", first.raw
                messages += [
                    {"role": "assistant", "content": first.content},
                    {"role": "user", "content": "And lakes? " * 10},
                ]
                second = await chat_turn(client, router.url, messages, conversation_id="dns-1")
                assert second.status == 200 and second.path == "reuse", second.raw
        finally:
            await asyncio.to_thread(router.stop)
