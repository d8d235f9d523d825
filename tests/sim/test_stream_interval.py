"""vLLM's --stream-interval in the simulator: the first token at once, then a chunk every N
tokens and the rest at the end; the text and ids are those of the whole answer."""

from __future__ import annotations

import json

import httpx

from tests.sim.helpers import LONG, chat_body, user
from tests.support.sims import running, sim_config


async def test_a_stream_sends_its_first_token_alone_then_chunks_of_the_interval() -> None:
    async with (
        running(sim_config(None, stream_interval=8)) as sim,
        httpx.AsyncClient(timeout=10) as client,
    ):
        body = chat_body([user(LONG)], max_tokens=21, ignore_eos=True)
        whole = (await client.post(sim.url + "/v1/chat/completions", json=body)).json()
        streamed: list[list[int]] = []
        text = ""
        async with client.stream(
            "POST", sim.url + "/v1/chat/completions", json={**body, "stream": True}
        ) as response:
            async for line in response.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                for choice in json.loads(line[6:])["choices"]:
                    if choice.get("token_ids"):
                        streamed.append(choice["token_ids"])
                        text += choice["delta"].get("content", "")
    assert [len(ids) for ids in streamed] == [1, 8, 8, 4]
    assert [i for ids in streamed for i in ids] == whole["choices"][0]["token_ids"]
    assert text == whole["choices"][0]["message"]["content"]
