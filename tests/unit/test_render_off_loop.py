"""Rendering on the event loop holds up every other turn on the worker: a request is rendered
in a thread when its text is long or its body is large, whatever part makes it large (a
10 MB ``tools`` list with a one-line message stalled a worker for 0.33 s)."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import msgspec
import pytest

from carryover.router.render.backends import LocalRenderer, bundled_qwen3_dir


def _tool(n: int) -> dict[str, Any]:
    return {
        "type": "function",
        "function": {
            "name": f"tool_{n}",
            "description": "Looks a river up by its index and says where it rises. " * 4,
            "parameters": {"type": "object", "properties": {"index": {"type": "integer"}}},
        },
    }


def _where_rendered(body: dict[str, Any], size: int) -> str:
    renderer = LocalRenderer(bundled_qwen3_dir())
    seen: list[str] = []
    render = renderer._render

    def recording(request: dict[str, Any], max_model_len: int | None) -> list[int]:
        seen.append(threading.current_thread().name)
        return render(request, max_model_len)

    renderer._render = recording  # type: ignore[method-assign]
    ids = asyncio.run(renderer.chat(body, "m", None, size=size))
    assert ids, "rendered"
    return "loop" if seen == [threading.main_thread().name] else "thread"


@pytest.mark.parametrize(
    ("tools", "where"), [(2, "loop"), (400, "thread")], ids=["a few tools", "a large tools list"]
)
def test_a_large_body_renders_off_the_loop_whatever_part_is_large(tools: int, where: str) -> None:
    body = {
        "messages": [{"role": "user", "content": "Which river is the longest?"}],
        "tools": [_tool(n) for n in range(tools)],
    }
    assert _where_rendered(body, len(msgspec.json.encode(body))) == where
