"""The tokens-only pipeline against real vLLM: a render server (``vllm launch render`` with the
Qwen3 reasoning and Hermes tool parsers) and a P/D pair started with ``--tokens-only``.

Its pair is the only one that cannot serve the other modules' tests (``engines("tokens")``,
last in the tier). The reference for an answer is the same pipeline without the router: the render server's
render, D alone (salted, so no cache of the routed turns colours it), the render server's
derender.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest

from carryover.bench.real.launch import VllmPair
from carryover.bench.real.render import RenderServerProcess
from carryover.bench.redis_server import RedisServer
from carryover.router.config import Timeouts
from carryover.router.engines.upstream import Upstream
from carryover.router.tokens.answers import StreamMender, mend_whole
from carryover.router.tokens.server import RenderServerClient
from carryover.router.tokens.stream import Coalescer
from tests.real.conftest import Engines, module_router, router_flags
from tests.real.helpers import COMPUTED, HITS, PULLED, SERVED_NAME, text, urls
from tests.real.served import (
    CASES,
    CHAT,
    PARSERS,
    SERVER_PARSERS,
    ServedAnswers,
    fold_stream,
    second_turn,
)
from tests.support.http import SAFE_TO_RESEND
from tests.support.metrics import ascrape
from tests.support.router_proc import RouterProcess
from tests.support.waiting import eventually

pytestmark = [pytest.mark.real, pytest.mark.engines("tokens")]


@pytest.fixture(scope="module")
def render_server(
    engines: Engines, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RenderServerProcess]:
    if engines.kind != "tokens":
        engines.stop()  # the last configuration's pair would take the cores from its start
    server = RenderServerProcess(
        tmp_path_factory.mktemp("render") / "render.log",
        parsers=SERVER_PARSERS,
    )
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def tokens_pair(engines: Engines, render_server: RenderServerProcess) -> VllmPair:
    return engines.pair("tokens")


def tokens_flags(render: RenderServerProcess, *extra: str) -> list[str]:
    return ["--engine-api", "tokens", "--render", render.url, "--render-timeout", "120", *extra]


@pytest.fixture(scope="module")
def tokens_router(
    engines: Engines,
    render_server: RenderServerProcess,
    redis_server: RedisServer,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[RouterProcess]:
    """The module's router (its tests read its counters as differences)."""
    flags = tokens_flags(
        render_server,
        *PARSERS,
        *("--stream-tokens", "8", "--stream-interval", "60", "--expose-path-header"),
    )
    pair = engines.pair("tokens")
    with module_router(pair, redis_server, tmp_path_factory.mktemp("router"), *flags) as router:
        yield router


def _chat(messages: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    return {
        "model": SERVED_NAME,
        "messages": messages,
        "max_tokens": 16,
        "temperature": 0,
        "ignore_eos": True,
        "logprobs": True,
        "top_logprobs": 1,
        "return_token_ids": True,
        **extra,
    }


async def _unrouted(
    client: httpx.AsyncClient, render: str, decode: str, body: dict[str, Any]
) -> dict[str, Any]:
    """The pipeline by hand, on D alone and off every cache."""
    salted = {**body, "cache_salt": uuid.uuid4().hex}
    # Each leg is safe to send twice: the render server keeps nothing, and D's run is salted
    # off every cache and read only for its answer.
    once = SAFE_TO_RESEND
    generate = (
        await client.post(render + "/v1/chat/completions/render", json=salted, extensions=once)
    ).json()
    generate["return_token_ids"] = True
    # The render server leaves out max_tokens when it equals vLLM's default of 16, and the
    # generate server would then run to the end of the context (router/tokens/legs.py).
    generate["sampling_params"]["max_tokens"] = body["max_tokens"]
    generated = (
        await client.post(decode + "/inference/v1/generate", json=generate, extensions=once)
    ).json()
    derender = {
        "stream": False,
        "generate_response": generated,
        "prompt_tokens": len(generate["token_ids"]),
        "chat_request": salted,
    }
    answer = (
        await client.post(render + "/v1/chat/completions/derender", json=derender, extensions=once)
    ).json()
    answer["choices"][0]["token_ids"] = generated["choices"][0]["token_ids"]
    return answer


def _same(got: dict[str, Any], want: dict[str, Any]) -> None:
    g, w = got["choices"][0], want["choices"][0]
    assert g["token_ids"] == w["token_ids"]
    assert g["message"]["reasoning"] == w["message"]["reasoning"]
    assert g["message"]["content"] == w["message"]["content"]
    got_lp = [e["logprob"] for e in g["logprobs"]["content"]]
    want_lp = [e["logprob"] for e in w["logprobs"]["content"]]
    assert max(abs(a - b) for a, b in zip(got_lp, want_lp, strict=True)) < 1e-3
    assert [e["token"] for e in g["logprobs"]["content"]] == [
        e["token"] for e in w["logprobs"]["content"]
    ]


async def test_tokens_turns_reuse_d_s_kv_and_answer_as_the_unrouted_pipeline(
    client: httpx.AsyncClient,
    tokens_pair: VllmPair,
    render_server: RenderServerProcess,
    tokens_router: RouterProcess,
) -> None:
    p_url, d_url = urls(tokens_pair)
    nonce = uuid.uuid4().hex[:8]
    # Long enough that whole 256-token chunks of the stored prefix (state/prefix.py) come
    # before each turn's divergence.
    messages = [{"role": "user", "content": text(nonce, 0, 400)}]
    pulled_tokens = []
    for turn in range(3):
        body = _chat(messages)
        before = (await ascrape(client, p_url)).get(PULLED, 0.0)
        r = await client.post(
            tokens_router.url + "/v1/chat/completions",
            json={**body, "conversation_id": nonce},
        )
        assert r.status_code == 200, r.text
        got = r.json()
        assert "kv_transfer_params" not in got and got["id"].startswith("chatcmpl-")
        pulled = (await ascrape(client, p_url)).get(PULLED, 0.0) - before
        pulled_tokens.append(pulled)
        _same(got, await _unrouted(client, render_server.url, d_url, body))
        message = got["choices"][0]["message"]
        messages += [
            {"role": "assistant", "content": message["content"] or ""},
            {"role": "user", "content": text(nonce, turn + 1, 40)},
        ]
    # Turn 1 is cold; later turns pull the history's whole blocks back from D. (The reasoning
    # parser puts the random model's output into `reasoning`, which the template does not
    # render back: the history diverges at the answer, so the reuse is partial.)
    assert pulled_tokens[0] == 0
    assert all(p >= 128 for p in pulled_tokens[1:]), pulled_tokens


async def test_a_streamed_tokens_turn_is_derendered_in_batches(
    client: httpx.AsyncClient, tokens_router: RouterProcess
) -> None:
    nonce = uuid.uuid4().hex[:8]
    body = _chat([{"role": "user", "content": text(nonce, 0, 40)}], max_tokens=24)
    uncaptured = "carryover_turns_without_handle_total{cause=streamed_generate}"
    before = (await ascrape(client, tokens_router.url)).get(uncaptured, 0)
    whole = (await client.post(tokens_router.url + "/v1/chat/completions", json=body)).json()
    frames: list[dict[str, Any]] = []
    async with client.stream(
        "POST", tokens_router.url + "/v1/chat/completions", json={**body, "stream": True}
    ) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                frames.append(msgspec.json.decode(line[6:]))
    choices = [f["choices"][0] for f in frames if f["choices"]]
    # 24 tokens: the first alone, then batches of 8 (the last one ends the answer).
    assert 2 <= len(choices) <= 5, len(choices)
    streamed = "".join(c["delta"].get("reasoning") or "" for c in choices)
    assert streamed == whole["choices"][0]["message"]["reasoning"]
    ids = [i for c in choices for i in c["token_ids"]]
    assert ids == whole["choices"][0]["token_ids"]
    assert choices[-1]["finish_reason"] == "length"
    # vLLM's parsed streaming derender returns no logprobs; the router resolves them, as the
    # render server does for the whole answer.
    streamed_lp = [e for c in choices for e in (c.get("logprobs") or {}).get("content") or ()]
    whole_lp = whole["choices"][0]["logprobs"]["content"]
    assert [(e["token"], e["bytes"]) for e in streamed_lp] == [
        (e["token"], e["bytes"]) for e in whole_lp
    ]
    assert [e["top_logprobs"][0]["token"] for e in streamed_lp] == [
        e["top_logprobs"][0]["token"] for e in whole_lp
    ]
    assert (
        max(abs(a["logprob"] - b["logprob"]) for a, b in zip(streamed_lp, whole_lp, strict=True))
        < 1e-3
    )
    # The stream (no conversation: nothing to capture for) left no handle, and says so once.
    assert (await ascrape(client, tokens_router.url)).get(uncaptured, 0) - before == 1


async def test_a_streamed_turn_s_handle_is_captured_from_d_s_cache_and_reused(
    client: httpx.AsyncClient,
    tokens_pair: VllmPair,
    render_server: RenderServerProcess,
    tokens_router: RouterProcess,
) -> None:
    """vLLM's streamed generate returns no handle. The router's one-token capture on D finds
    the streamed sequence in D's prefix cache (computing only its last partial block), and
    the next turn's P pulls the history from that handle."""
    p_url, d_url = urls(tokens_pair)
    nonce = uuid.uuid4().hex[:8]
    messages = [{"role": "user", "content": text(nonce, 0, 400)}]
    body = {**_chat(messages, max_tokens=24), "conversation_id": nonce, "stream": True}
    before = await ascrape(client, d_url)
    content = ""
    async with client.stream("POST", tokens_router.url + "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                for choice in msgspec.json.decode(line[6:])["choices"]:
                    content += choice["delta"].get("content") or ""
    after = await ascrape(client, d_url)
    # D's prompts: the stream's (pulled from P) and the capture's, which hit D's own cache
    # for every whole block of the sequence and computed less than a block.
    hits = after.get(HITS, 0.0) - before.get(HITS, 0.0)
    computed = after.get(COMPUTED, 0.0) - before.get(COMPUTED, 0.0)
    assert hits >= 3 * 128, (hits, computed)
    assert computed <= 2 * 128, (hits, computed)
    metrics = await ascrape(client, tokens_router.url)
    assert metrics.get("carryover_turns_without_handle_total{cause=capture_failed}", 0) == 0
    messages += [
        {"role": "assistant", "content": content},
        {"role": "user", "content": text(nonce, 1, 40)},
    ]
    second = _chat(messages)
    pulled = (await ascrape(client, p_url)).get(PULLED, 0.0)
    r2 = await client.post(
        tokens_router.url + "/v1/chat/completions", json={**second, "conversation_id": nonce}
    )
    assert r2.status_code == 200, r2.text
    assert r2.headers.get("x-carryover-path") in ("reuse", "partial")
    assert (await ascrape(client, p_url)).get(PULLED, 0.0) - pulled >= 128
    _same(r2.json(), await _unrouted(client, render_server.url, d_url, second))


async def test_a_stream_no_parser_needs_is_detokenized_in_the_router(
    client: httpx.AsyncClient, tokens_router: RouterProcess
) -> None:
    """A streamed completion (no parser runs on completions) is detokenized in the router,
    chunk by chunk, and says what the render server says for the whole answer."""
    nonce = uuid.uuid4().hex[:8]
    body = {
        "model": SERVED_NAME,
        "prompt": text(nonce, 0, 40),
        "max_tokens": 24,
        "temperature": 0,
        "ignore_eos": True,
    }
    url = tokens_router.url + "/v1/completions"
    whole = (await client.post(url, json=body)).json()
    pieces: list[str] = []
    async with client.stream("POST", url, json={**body, "stream": True}) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                pieces += [c["text"] for c in msgspec.json.decode(line[6:])["choices"]]
    assert "".join(pieces) == whole["choices"][0]["text"]
    assert len(pieces) > 5  # chunk by chunk, not held in batches of 8
    assert whole["id"].startswith("cmpl-")


async def test_the_render_server_s_gaps_are_mended(
    client: httpx.AsyncClient, render_server: RenderServerProcess
) -> None:
    """Tool calls through the real render server: a whole answer says `tool_calls` (vLLM
    0.32 says `stop`), a streamed one keeps one id per call."""
    tools = [
        {
            "type": "function",
            "function": {
                "name": "get",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
            },
        }
    ]
    request = {"model": SERVED_NAME, "messages": [{"role": "user", "content": "?"}], "tools": tools}
    said = '<tool_call>\n{"name": "get", "arguments": {"city": "Paris"}}\n</tool_call>'
    r = await client.post(
        render_server.url + "/tokenize", json={"model": SERVED_NAME, "prompt": said}
    )
    ids = r.json()["tokens"] + [151645]  # <|im_end|>: the model stopped
    generated = {
        "request_id": "generate-tokens-t1",
        "model": SERVED_NAME,
        "created": 0,
        "output_mode": "tokens",
        "usage": {"prompt_tokens": 5, "completion_tokens": len(ids), "total_tokens": 0},
        "choices": [{"index": 0, "finish_reason": "stop", "token_ids": ids, "logprobs": None}],
    }
    upstream = Upstream(Timeouts())
    try:
        server = RenderServerClient(upstream, render_server.url, 120)
        answer = await server.derender(generated, 5, request, chat=True)
        assert answer["choices"][0]["finish_reason"] == "stop"  # the gap, as vLLM 0.32 has it
        mended = mend_whole(answer, generated, client_wants_ids=False, chat=True)
        assert mended["choices"][0]["finish_reason"] == "tool_calls"
        assert mended["choices"][0]["message"]["tool_calls"][0]["function"]["name"] == "get"

        mender = StreamMender(client_wants_ids=False, chat=True)
        coalescer = Coalescer(
            server, request, [1, 2, 3], chat=True, mender=mender, max_tokens=3, max_wait=60
        )
        frames: list[bytes] = []
        for start in range(0, len(ids), 2):
            part = ids[start : start + 2]
            last = start + 2 >= len(ids)
            chunk = {
                "request_id": "generate-tokens-t1",
                "choices": [
                    {
                        "index": 0,
                        "token_ids": part,
                        "finish_reason": "stop" if last else None,
                        "logprobs": None,
                    }
                ],
            }
            frames += await coalescer.feed(chunk)
        assert coalescer.calls < len(ids) // 2  # batched, not one call per chunk
        chunks = [msgspec.json.decode(f[6:]) for f in frames]
        calls = [
            call
            for c in chunks
            for choice in c["choices"]
            for call in choice["delta"].get("tool_calls") or ()
        ]
        assert {call["id"] for call in calls if call.get("id")} and len(
            {call["id"] for call in calls if call.get("id")}
        ) == 1
        arguments = "".join(call["function"].get("arguments") or "" for call in calls)
        assert msgspec.json.decode(arguments) == {"city": "Paris"}
        assert chunks[-1]["choices"][-1]["finish_reason"] == "tool_calls"
    finally:
        await upstream.aclose()


async def test_stop_strings_and_a_mismatched_render_server_are_refused_clearly(
    client: httpx.AsyncClient,
    tokens_pair: VllmPair,
    render_server: RenderServerProcess,
    tokens_router: RouterProcess,
    redis_server: RedisServer,
    tmp_path: Path,
) -> None:
    body = _chat([{"role": "user", "content": "hi"}], stop=["x"])
    r = await client.post(tokens_router.url + "/v1/chat/completions", json=body)
    assert r.status_code == 400 and "stop_token_ids" in r.json()["error"]["message"]
    # A router told of no parsers, in front of a render server that has two.
    router = RouterProcess(
        router_flags(tokens_pair, redis_server, *tokens_flags(render_server)), tmp_path / "bad"
    )
    try:
        await router.start(timeout=180, ready=False)

        async def readiness() -> str:
            ready = await client.get(router.url + "/ready")
            return "" if ready.status_code == 200 else str(ready.json()["error"]["message"])

        reason = await eventually(
            readiness, lambda m: "does not match" in m, what="the check's verdict", timeout=300
        )
        assert "reasoning parser" in reason and "tool-call parser" in reason
        hello = _chat([{"role": "user", "content": "hi"}])
        r = await client.post(router.url + "/v1/chat/completions", json=hello)
        assert r.status_code == 503 and "does not match" in r.json()["error"]["message"]
    finally:
        router.stop()


async def _answer(client: httpx.AsyncClient, url: str, path: str, body: dict[str, Any]) -> Any:
    """A whole answer, or a stream folded into one (``served.fold_stream``)."""
    if not body.get("stream"):
        r = await client.post(url + path, json=body)
        assert r.status_code == 200, r.text
        return r.json()
    async with client.stream("POST", url + path, json=body) as r:
        assert r.status_code == 200
        return fold_stream([line async for line in r.aiter_lines()])


def _close(got: list[dict[str, Any]], want: list[dict[str, Any]]) -> None:
    assert [e["token"] for e in got] == [e["token"] for e in want]
    gaps = [abs(a["logprob"] - b["logprob"]) for a, b in zip(got, want, strict=True)]
    assert max(gaps, default=0.0) < 1e-3


def _as_served(got: Any, want: Any, *, stream: bool) -> None:
    usage = ("prompt_tokens", "completion_tokens", "total_tokens")
    assert [got["usage"][k] for k in usage] == [want["usage"][k] for k in usage]
    assert got["id"].split("-")[0] == want["id"].split("-")[0]  # chatcmpl- / cmpl-
    if stream:
        for field in ("text", "reasoning", "tools", "finish_reason"):
            assert got[field] == want[field], field
        _close(got["logprobs"], want["logprobs"])
        return
    g, w = got["choices"][0], want["choices"][0]
    assert g["finish_reason"] == w["finish_reason"]
    if "message" in w:
        for field in ("content", "reasoning"):
            assert g["message"].get(field) == w["message"].get(field), field
        calls = [
            (c["function"]["name"], c["function"]["arguments"])
            for c in w["message"].get("tool_calls") or ()
        ]
        assert [
            (c["function"]["name"], c["function"]["arguments"])
            for c in g["message"].get("tool_calls") or ()
        ] == calls
        _close(g["logprobs"]["content"], w["logprobs"]["content"])
    else:
        assert g["text"] == w["text"]
        assert g["logprobs"]["tokens"] == w["logprobs"]["tokens"]


async def test_answers_equal_vllm_serve_s_with_the_same_parsers(
    client: httpx.AsyncClient,
    served_answers: ServedAnswers,
    tokens_router: RouterProcess,
) -> None:
    """The same requests through the router (render → P → D → derender, a second turn
    reusing the first's handle) and to one ``vllm serve`` with the same parsers (recorded on
    ``pd``'s P, tests/real/served.py): content, reasoning, tool calls, finish reason, usage and
    logprobs agree."""
    conversation = uuid.uuid4().hex[:8]
    routed_answers = []
    for path, body, first_turn in CASES:
        extra = {"conversation_id": conversation} if first_turn else {}
        routed_answers.append(await _answer(client, tokens_router.url, path, {**body, **extra}))
    for (_, body, _), got, want in zip(CASES, routed_answers, served_answers.answers, strict=True):
        _as_served(got, want, stream=bool(body.get("stream")))
    # The second turn of the conversation, through the stored handle: the same body as the
    # one served, since the first answers agree.
    second_body = second_turn(routed_answers[0])
    assert second_body == served_answers.second_body
    r = await client.post(
        tokens_router.url + CHAT, json={**second_body, "conversation_id": conversation}
    )
    assert r.status_code == 200 and r.headers["x-carryover-path"] in ("reuse", "partial"), r.text
    _as_served(r.json(), served_answers.second_answer, stream=False)
