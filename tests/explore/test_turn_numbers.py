"""Turn N is the Nth turn of the conversation, for an agent loop too: one user message, then
the assistant's tool calls and the tools' results, each a turn."""

from __future__ import annotations

import json
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from carryover.router.config.load import load_config
from carryover.router.http.app import create_app
from carryover.state import MemoryStore
from tests.explore.engines import MODEL, Engines
from tests.explore.schedules import KEYS, NOW, until


def _answered_by_turn(metrics: str) -> dict[str, float]:
    counts: dict[str, float] = {}
    for family in text_string_to_metric_families(metrics):
        for sample in family.samples:
            if sample.name == "carryover_answer_seconds_count":
                turn = sample.labels["turn"]
                counts[turn] = counts.get(turn, 0.0) + sample.value
    return counts


async def test_an_agent_loops_turns_are_numbered_in_the_metrics() -> None:
    engines = Engines(["p0:8000"], ["d0:8000"])
    args = ["--prefill", "http://p0:8000", "--decode", "http://d0:8000"]
    args += ["--render-backend", "engine", "--expose-path-header", "--health-interval", "3600"]
    environ = {"CARRYOVER_API_KEYS": json.dumps(KEYS), "CARRYOVER_ADMIN_KEY": "sk-admin"}
    config = load_config(args, environ=environ)
    app = create_app(
        config, transport=engines, store=MemoryStore(clock=lambda: NOW), clock=lambda: NOW
    )
    auth = {"Authorization": "Bearer k1"}
    async with (
        app.lifespan(),
        httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://r") as client,
    ):
        services = app.state.services
        await until(lambda: all(r.name for r in services.models), "the model's name")
        messages: list[dict[str, Any]] = [
            {"role": "user", "content": "list the rivers of the valley, one tool call each"}
        ]
        paths = []
        for step in range(10):
            body = {"model": MODEL, "messages": messages, "conversation_id": "agent"}
            reply = await client.post("/v1/chat/completions", json=body, headers=auth)
            assert reply.status_code == 200, reply.text
            paths.append(reply.headers["x-carryover-path"])
            call = {
                "id": f"call-{step}",
                "type": "function",
                "function": {"name": "river", "arguments": json.dumps({"index": step})},
            }
            messages = [
                *messages,
                {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": f"call-{step}", "content": f"river {step}"},
            ]
        admin = {"Authorization": "Bearer sk-admin"}
        metrics = (await client.get("/metrics", headers=admin)).text
    assert _answered_by_turn(metrics) == {"1": 1, "2": 1, "3-5": 3, "6-10": 5}
