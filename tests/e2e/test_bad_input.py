"""Bad input gets OpenAI's error shape with the right 4xx, never a traceback or a 500.

Every case here is refused without touching a conversation's state, so the module shares one
router (and its simulated engines) on one event loop: one stack instead of one per case. A
refusal that left the router unable to serve the next case would fail that case too.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio

from tests.support.stack import Stack, stack

pytestmark = pytest.mark.asyncio(loop_scope="module")

_CONTEXT = 2048  # the engines' max_model_len


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def bad_input_stack(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Stack]:
    log_dir: Path = tmp_path_factory.mktemp("bad-input")
    async with stack(
        log_dir,
        router_flags=(
            "--max-body-bytes",
            "65536",
            "--max-messages",
            "16",
            "--max-nesting-depth",
            "12",
        ),
        sim={"max_model_len": _CONTEXT},
    ) as s:
        yield s


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        (
            {
                "messages": [{"role": "user", "content": "x"}],
                "kv_transfer_params": {"remote_block_ids": [[1]]},
            },
            400,
            "kv_transfer_params",
        ),
        (
            {"messages": [{"role": "user", "content": "x"}], "conversation_id": "has space"},
            400,
            "conversation_id",
        ),
        (
            {"messages": [{"role": "user", "content": "x"}], "conversation_id": "x" * 257},
            400,
            "conversation_id",
        ),
        *(
            (
                {"messages": [{"role": "user", "content": "x"}], "conversation_id": bad},
                400,
                "conversation_id",
            )
            for bad in ("a//b", "/a", "a/")
        ),
        ({"messages": [{"role": "user", "content": "x"}], "model": "nope"}, 404, "model"),
        ({"messages": [{"role": "user", "content": "x"}], "n": 2}, 400, "n"),
        ({"messages": [{"role": "user", "content": "x"}], "max_tokens": 0}, 400, "max_tokens"),
        ({"messages": "hello"}, 400, None),
        ({"messages": []}, 400, "messages"),
        ({"messages": [{"role": "wizard", "content": "x"}]}, 400, "messages"),
        ({"messages": [{"role": {}, "content": "x"}]}, 400, "messages"),  # unhashable role
        ({"messages": [{"role": "user", "content": "x"}] * 20}, 400, "messages"),
        (
            {"messages": [{"role": "user", "content": "x"}], "temperature": 0.9},
            400,
            None,
        ),  # the engine's 400
        *(
            (
                {
                    "messages": [{"role": "user", "content": "x"}],
                    "chat_template_kwargs": {name: value},
                },
                400,
                "chat_template_kwargs",
            )
            for name, value in (
                ("messages", [{"role": "user", "content": "y"}]),
                ("tools", []),
                ("add_generation_prompt", False),
            )
        ),
        (
            # Tool-call arguments nested past any parser's depth: vLLM answers 400.
            {
                "messages": [
                    {"role": "user", "content": "x"},
                    {
                        "role": "assistant",
                        "content": None,
                        "tool_calls": [
                            {
                                "id": "c1",
                                "type": "function",
                                "function": {"name": "f", "arguments": "[" * 5000 + "]" * 5000},
                            }
                        ],
                    },
                    {"role": "tool", "tool_call_id": "c1", "content": "r"},
                ]
            },
            400,
            None,
        ),
        (
            {
                "messages": [{"role": "user", "content": "x"}],
                "tools": [
                    {"type": "function", "function": {"name": f"f{n}", "parameters": {}}}
                    for n in range(1025)
                ],
            },
            400,
            "tools",
        ),
        *(
            (
                {"messages": [{"role": "user", "content": "x"}], "cache_salt": salt},
                400,
                "cache_salt",
            )
            for salt in ("", 7, "a/b", "x" * 129)
        ),
    ],
)
async def test_bad_bodies_get_openai_errors(
    body: dict[str, Any], status: int, param: str | None, bad_input_stack: Stack
) -> None:
    s = bad_input_stack
    r = await s.client.post(
        s.router.url + "/v1/chat/completions", json={"model": "sim-qwen3", **body}
    )
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["code"] == status and error["message"]
    if param is not None:
        assert error["param"] == param


async def test_a_prompt_past_the_models_context_is_refused_before_any_engine_sees_it(
    bad_input_stack: Stack,
) -> None:
    s = bad_input_stack
    asked = [sim.generations_asked for sim in (*s.prefill, *s.decode)]
    # About three tokens a word: past the context, within the body limit and the
    # characters a context's tokens can hold (vLLM's two checks, docs/operations.md).
    long_text = " ".join(f"w{n}" for n in range(_CONTEXT))
    cases = [
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": long_text}]}),
        ("/v1/completions", {"prompt": long_text}),
        ("/v1/completions", {"prompt": [7] * (_CONTEXT + 1)}),
    ]
    for path, body in cases:
        r = await s.client.post(s.router.url + path, json={"model": "sim-qwen3", **body})
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == "input_tokens", error
        assert f"maximum context length is {_CONTEXT} tokens" in error["message"]
    assert [sim.generations_asked for sim in (*s.prefill, *s.decode)] == asked
    # At the context less the answer's room, the same prompt is served.
    fits = {"prompt": [7] * (_CONTEXT - 8), "max_tokens": 4}
    r = await s.client.post(s.router.url + "/v1/completions", json={"model": "sim-qwen3", **fits})
    assert r.status_code == 200, r.text


def _nested(depth: int) -> Any:
    """A JSON value ``depth`` levels deep (objects and arrays alternating)."""
    value: Any = "leaf"
    for level in range(depth):
        value = {"a": value} if level % 2 else [value]
    return value


def _arguments_call(depth: int) -> dict[str, Any]:
    call = {"name": "f", "arguments": json.dumps(_nested(depth))}
    return {
        "messages": [
            {"role": "user", "content": "x"},
            {
                "role": "assistant",
                "tool_calls": [{"id": "c", "type": "function", "function": call}],
            },
            {"role": "tool", "tool_call_id": "c", "content": "ok"},
        ]
    }


@pytest.mark.parametrize("where", ["body", "tool call arguments", "completion"])
async def test_json_nested_past_max_nesting_depth_is_400_and_at_it_is_served(
    bad_input_stack: Stack, where: str
) -> None:
    s = bad_input_stack

    def request(depth: int) -> tuple[str, dict[str, Any]]:
        if where == "completion":  # the top object and its "x" field are two levels
            return "/v1/completions", {"prompt": "hi", "max_tokens": 2, "x": _nested(depth - 1)}
        if where == "body":  # the top object, "x" and the nested value under it
            return "/v1/chat/completions", {
                "messages": [{"role": "user", "content": "x"}],
                "max_tokens": 2,
                "x": _nested(depth - 1),
            }
        return "/v1/chat/completions", {**_arguments_call(depth), "max_tokens": 2}

    for depth, status in ((12, 200), (13, 400)):
        path, body = request(depth)
        r = await s.client.post(s.router.url + path, json={"model": "sim-qwen3", **body})
        assert r.status_code == status, (depth, r.text)
    error = r.json()["error"]
    assert error["code"] == 400 and "nested more than 12 deep" in error["message"]
    assert error["param"] == ("messages" if where == "tool call arguments" else None)


@pytest.mark.parametrize(
    "prompt", [[1, -1], [2017, 7874619527822778658960633979994112], [2**31], [], ""]
)
async def test_bad_token_id_prompts_are_400(bad_input_stack: Stack, prompt: Any) -> None:
    s = bad_input_stack
    r = await s.client.post(
        s.router.url + "/v1/completions",
        json={"model": "sim-qwen3", "prompt": prompt, "conversation_id": "ids"},
    )
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "prompt"


@pytest.mark.parametrize(
    ("raw", "status"),
    [
        (b"{not json", 400),
        (b"[1, 2]", 400),
        (b'{"messages": [{"role": "user", "content": "\xff\xfe"}]}', 400),
        (b"[" * 30_000 + b"]" * 30_000, 400),
        (b"{" + b'"a": "' + b"x" * 70_000 + b'"}', 413),
    ],
)
async def test_malformed_bytes_get_openai_errors(
    raw: bytes, status: int, bad_input_stack: Stack
) -> None:
    s = bad_input_stack
    r = await s.client.post(
        s.router.url + "/v1/chat/completions",
        content=raw,
        headers={"content-type": "application/json"},
    )
    assert r.status_code == status, r.text
    assert r.json()["error"]["code"] == status


async def test_a_body_over_the_limit_without_a_length_is_413_too(bad_input_stack: Stack) -> None:
    s = bad_input_stack

    async def chunks() -> AsyncIterator[bytes]:  # chunked: no Content-Length to refuse early
        yield b'{"model": "sim-qwen3", "prompt": "'
        for _ in range(8):
            yield b"x" * 10_000
        yield b'"}'

    r = await s.client.post(s.router.url + "/v1/completions", content=chunks())
    assert r.status_code == 413, r.text
    assert r.json()["error"]["type"] == "RequestTooLargeError"


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
@pytest.mark.parametrize("method", ["GET", "PUT", "DELETE"])
async def test_other_methods_on_the_endpoints_are_an_openai_405(
    bad_input_stack: Stack, method: str, path: str
) -> None:
    r = await bad_input_stack.client.request(method, bad_input_stack.router.url + path)
    assert r.status_code == 405, r.text
    assert r.json()["error"]["type"] == "MethodNotAllowedError"


async def test_unknown_route_is_an_openai_404(bad_input_stack: Stack) -> None:
    r = await bad_input_stack.client.get(bad_input_stack.router.url + "/v1/nothing")
    assert r.status_code == 404 and r.json()["error"]["code"] == 404


async def test_a_request_id_engines_could_not_take_is_replaced(bad_input_stack: Stack) -> None:
    # Forwarded verbatim, a non-ASCII X-Request-Id made the engine answer 500: any client
    # could fail requests at will (and count as the instance's failures).
    s = bad_input_stack
    for request_id in ("café-ü".encode(), "café".encode("latin-1"), b"x" * 200, b"tab\there"):
        r = await s.client.post(
            f"{s.router.url}/v1/chat/completions",
            json={"messages": [{"role": "user", "content": "Hi."}]},
            headers={b"X-Request-Id": request_id},
        )
        assert r.status_code == 200, (request_id, r.text)
    # The log keeps what the client sent, escaped, beside the id the engines got.
    kept = [
        json.loads(line)["client_request_id"]
        for line in s.router.log().splitlines()
        if '"client_request_id": "' in line
    ]
    assert "'tab\\there'" in kept and any(k.startswith("'caf") for k in kept), kept
