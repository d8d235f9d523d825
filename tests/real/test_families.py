"""Model families beyond Qwen3 on real vLLM: a Llama 2 (SentencePiece tokenizer, a template
that insists on alternating roles) and a Mistral (tekken tokenizer, tools, tool call ids of
nine characters), each a seeded random model the tier builds (``bench/real/make_model.py``).

The router is given the model's folder (``--tokenizer``); its render check agrees with P's
``/tokenize`` (some probes are refused by both templates alike), and from then on it renders
every turn in process. A conversation's turns carry exactly the ids P's ``/tokenize`` gives,
answer as P alone does, and P pulls from D exactly the tokens the handle covers (all of
them, or the whole blocks before the first difference inside the previous answer), by P's
counters.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest

from carryover.bench.real.launch import ensure_model
from carryover.bench.redis_server import RedisServer
from tests.real.conftest import Engines, routed
from tests.real.helpers import (
    chat,
    expected_pull,
    forget_prefill_cache,
    pulled,
    salted,
    same_output,
    text,
    tokenize,
    urls,
)
from tests.support.metrics import ascrape
from tests.support.waiting import eventually

pytestmark = pytest.mark.real

AGREES = "carryover_render_check{model=0,state=agrees}"


@pytest.mark.parametrize(
    "family", [pytest.param(f, marks=pytest.mark.engines(f)) for f in ("llama2", "mistral")]
)
async def test_a_family_renders_in_process_and_its_turns_reuse_exactly_what_d_holds(
    family: str,
    engines: Engines,
    redis_server: RedisServer,
    client: httpx.AsyncClient,
    tmp_path: Path,
) -> None:
    pair = engines.pair(family)
    p_url, _ = urls(pair)
    model = pair.served_name
    folder = ensure_model(family)
    async with routed(pair, redis_server, tmp_path, "--tokenizer", str(folder)) as router:
        await eventually(
            lambda: ascrape(client, router.url),
            lambda values: values.get(AGREES) == 1.0,
            what=f"the router's renderer agrees with vLLM's for {family}",
            timeout=120,
        )
        nonce = f"{family}-0001"  # fixed: the seeded model answers the same every run
        messages: list[dict[str, Any]] = [
            {"role": "system", "content": "Answer in one line."},
            {"role": "user", "content": text(nonce, 0, 300)},
        ]
        if family == "mistral":
            messages = messages[1:]  # its template moves the system prompt to the last turn
        sequence: list[int] | None = None
        paths = []
        for turn in range(3):
            await forget_prefill_cache(client, p_url, router.url, model)
            before = await pulled(client, p_url)
            r = await chat(
                client,
                router.url,
                messages,
                model=model,
                max_tokens=40,
                conversation=nonce,
            )
            assert r.status_code == 200, r.text
            got = r.json()
            after = await pulled(client, p_url)
            prompt = got["prompt_token_ids"]
            want_ids = await tokenize(
                client, p_url, model=model, messages=messages, add_generation_prompt=True
            )
            assert prompt == want_ids, f"turn {turn + 1}: the router's ids are not vLLM's"
            want = await chat(client, p_url, messages, model=model, max_tokens=40, **salted())
            assert same_output(got, want.json(), chat=True), f"turn {turn + 1} differs"
            if sequence is not None:
                expected, path = expected_pull(prompt, sequence)
                assert after - before == expected, (r.headers["x-carryover-path"], expected, path)
                assert r.headers["x-carryover-path"] == path
                paths.append(path)
            sequence = prompt + got["choices"][0]["token_ids"]
            messages += [
                {"role": "assistant", "content": got["choices"][0]["message"]["content"]},
                {"role": "user", "content": text(nonce, turn + 1, 40)},
            ]
        assert "cold-mismatch" not in paths  # each later turn pulled something
