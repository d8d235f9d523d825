"""Hostile and malformed input against a live router: never a 5xx, never a crash, never an
engine field in a response, bounded memory. A fixed example budget keeps it CI-sized."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from carryover.bench.procs import Process

BUDGET = settings(
    max_examples=120, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True
)
FORBIDDEN = ("kv_transfer_params", "remote_block_ids", "remote_engine_id", "remote_host")


def _rss_kb(pid: int) -> int:
    total = 0
    for child in [pid, *_children(pid)]:
        for line in Path(f"/proc/{child}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                total += int(line.split()[1])
    return total


def _children(pid: int) -> list[int]:
    found: list[int] = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        for child in (task / "children").read_text().split():
            found += [int(child), *_children(int(child))]
    return found


json_scalar = (
    st.none()
    | st.booleans()
    | st.integers(-(2**40), 2**40)
    | st.floats(allow_nan=False, allow_infinity=False)  # what JSON can carry
    | st.text(max_size=40)
)
json_value = st.recursive(
    json_scalar,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4)
    ),
    max_leaves=12,
)
content = (
    st.text(max_size=200)
    | st.none()
    | json_value
    | st.lists(
        st.fixed_dictionaries(
            {"type": st.sampled_from(["text", "image_url"]), "text": st.text(max_size=50)}
        ),
        max_size=3,
    )
)
message = st.fixed_dictionaries(
    {
        "role": st.sampled_from(["user", "assistant", "system", "tool", "wizard", ""])
        | st.text(max_size=8),
        "content": content,
    }
)
conversation_id = st.text(max_size=300) | st.integers() | st.none()
chat_body = st.fixed_dictionaries(
    {"messages": st.lists(message, max_size=5) | json_value},
    optional={
        "model": st.sampled_from(["sim-qwen3", "other"]) | st.text(max_size=10),
        "max_tokens": st.integers(-5, 10) | st.integers(10**6, 10**9) | json_scalar,
        "stream": st.booleans() | json_scalar,
        "conversation_id": conversation_id,
        "temperature": st.sampled_from([0, 0.0, 1.5]) | json_scalar,
        "n": st.integers(0, 3),
        "kv_transfer_params": json_value,
        "return_token_ids": st.booleans(),
        "stop": st.text(max_size=5) | st.lists(st.text(max_size=5), max_size=2),
        "extra_field": json_value,
    },
)
completion_body = st.fixed_dictionaries(
    {
        "prompt": st.text(max_size=100)
        | st.lists(st.integers(-3, 200_000), max_size=20)
        | json_value
    },
    optional={
        "model": st.just("sim-qwen3"),
        "max_tokens": st.integers(-2, 8),
        "stream": st.booleans(),
        "conversation_id": conversation_id,
    },
)
# What an HTTP client can send at all: no leading or trailing blanks (h11 refuses them).
header_value = st.text(
    alphabet=st.characters(min_codepoint=32, max_codepoint=126), max_size=300
).map(str.strip)


def _check(response: httpx.Response) -> None:
    assert response.status_code < 500, response.text[:300]
    text = response.text
    for field in FORBIDDEN:
        assert field not in text or response.status_code == 400, text[:300]
    if response.status_code >= 400:
        error = response.json()["error"]
        assert error["code"] == response.status_code and isinstance(error["message"], str)


def _post(router: Process, path: str, **kwargs: Any) -> httpx.Response:
    with httpx.Client(timeout=60) as client:
        response = client.post(router.url + path, **kwargs)
        response.read()
        return response


def test_bodies_headers_and_bytes_never_break_the_router(router: Process) -> None:
    rss_before = _rss_kb(router.popen.pid)

    @BUDGET
    @given(body=chat_body, header=header_value)
    def chat(body: dict[str, Any], header: str) -> None:
        _check(
            _post(router, "/v1/chat/completions", json=body, headers={"X-Conversation-ID": header})
        )

    @BUDGET
    @given(body=completion_body)
    def completions(body: dict[str, Any]) -> None:
        _check(_post(router, "/v1/completions", json=body))

    @BUDGET
    @given(raw=st.binary(max_size=400))
    def raw_bytes(raw: bytes) -> None:
        _check(
            _post(
                router,
                "/v1/chat/completions",
                content=raw,
                headers={"Content-Type": "application/json"},
            )
        )

    chat()
    completions()
    raw_bytes()
    # The router is still healthy and did not grow without bound.
    assert httpx.get(router.url + "/ready", timeout=5).status_code == 200
    assert _rss_kb(router.popen.pid) - rss_before < 150_000
