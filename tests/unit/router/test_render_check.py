"""The default renderer renders in process only after P's /tokenize said the same ids, and
goes back to P when P disagrees, restarts with another tokenizer, or a request carries fields
only the engine applies."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, cast

import pytest
from litestar.testing import AsyncTestClient

from carryover.router.config.load import load_config
from carryover.router.errors import ClientError
from carryover.router.http.app import create_app
from carryover.router.render.auto import AutoRenderer, RenderCheck
from carryover.router.render.backends import EngineTokenize, LocalRenderer
from carryover.router.render.chat_template import ChatTemplate
from carryover.router.render.errors import RenderDeclined
from tests.support.waiting import eventually
from tests.unit.router.fakes import FakeEngine, FakeFleet, Tokenizer, fake_tokenize

QWEN3 = ChatTemplate.qwen3()


def qwen3_tokenize(body: dict[str, Any]) -> list[int]:
    if "messages" not in body:
        return QWEN3.encode(body["prompt"])
    return QWEN3.render(
        body["messages"],
        add_generation_prompt=bool(body.get("add_generation_prompt", True)),
        tools=body.get("tools"),
        chat_template_kwargs=body.get("chat_template_kwargs") or {},
    )


@dataclass
class Rig:
    client: AsyncTestClient[Any]
    fleet: FakeFleet
    p: FakeEngine

    async def state(self) -> str:
        text = (await self.client.get("/metrics")).text
        for line in text.splitlines():
            if line.startswith("carryover_render_check{") and line.endswith(" 1.0"):
                return line.split('state="')[1].split('"')[0]
        return "none"

    async def until(self, state: str) -> None:
        await eventually(self.state, lambda s: s == state, what=f"render check {state}")

    async def chat(self, turn: int, **extra: Any) -> list[int]:
        messages = [{"role": "user", "content": f"question {turn}"}]
        body = {"messages": messages, "conversation_id": "c", **extra}
        r = await self.client.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        ids: list[int] = self.p.requests[-1]["kv_transfer_params"]["prompt_token_ids"]
        return ids


@pytest.fixture
def tokenize() -> Tokenizer:
    return qwen3_tokenize


@pytest.fixture
async def rig(tokenize: Tokenizer) -> AsyncIterator[Rig]:
    p, d = FakeEngine("prefill", "p0:8000"), FakeEngine("decode", "d0:8000")
    flags = ["--prefill", p.url, "--decode", d.url, "--health-interval", "0.05"]
    fleet = FakeFleet(p, d, tokenize=tokenize)
    app = create_app(load_config(flags, environ={}), transport=fleet, seed=0)
    async with AsyncTestClient(app=app) as client:
        yield Rig(client, fleet, p)


async def test_an_agreeing_engine_hands_rendering_to_the_router(rig: Rig) -> None:
    await rig.until("agrees")
    calls = rig.fleet.tokenize_calls
    ids = await rig.chat(1)
    assert ids == qwen3_tokenize({"messages": [{"role": "user", "content": "question 1"}]})
    assert rig.fleet.tokenize_calls == calls  # rendered here, P not asked


async def test_fields_only_the_engine_applies_still_go_to_the_engine(rig: Rig) -> None:
    await rig.until("agrees")
    calls = rig.fleet.tokenize_calls
    await rig.chat(1, add_generation_prompt=False, continue_final_message=True)
    assert rig.fleet.tokenize_calls == calls + 1


@pytest.mark.parametrize("tokenize", [fake_tokenize])
async def test_a_disagreeing_engine_keeps_rendering(rig: Rig) -> None:
    await rig.until("disagrees")
    calls = rig.fleet.tokenize_calls
    ids = await rig.chat(1)
    assert ids == fake_tokenize({"messages": [{"role": "user", "content": "question 1"}]})
    assert rig.fleet.tokenize_calls == calls + 1


async def test_a_prefill_restarted_with_another_tokenizer_is_checked_again(rig: Rig) -> None:
    await rig.until("agrees")
    rig.fleet.tokenize = fake_tokenize  # a new deployment behind the same address
    rig.fleet.start_time = 2.0
    await rig.until("disagrees")
    ids = await rig.chat(1)
    assert ids == fake_tokenize({"messages": [{"role": "user", "content": "question 1"}]})


def no_tools_tokenize(body: dict[str, Any]) -> list[int]:
    if body.get("tools"):
        raise ValueError("this template takes no tools")
    return qwen3_tokenize(body)


@pytest.mark.parametrize("tokenize", [no_tools_tokenize])
async def test_an_engine_that_refuses_a_probe_keeps_rendering_and_is_not_asked_again(
    rig: Rig,
) -> None:
    await rig.until("disagrees")
    calls = rig.fleet.tokenize_calls
    await rig.chat(1)
    assert rig.fleet.tokenize_calls == calls + 1  # the turn's render, no further probes


class _Side:
    """A renderer side that says the same ids as the other, and can run a hook on a call."""

    def __init__(self, on_call: Callable[[], None] = lambda: None) -> None:
        self.on_call = on_call

    async def chat(self, body: dict[str, Any], model: str, engine_url: str | None) -> list[int]:
        self.on_call()
        return qwen3_tokenize(body)

    async def text(self, prompt: str, model: str, engine_url: str | None) -> list[int]:
        self.on_call()
        return QWEN3.encode(prompt)


async def test_a_check_that_overlaps_a_prefill_restart_does_not_count() -> None:
    engine = _Side()
    renderer = AutoRenderer(cast(EngineTokenize, engine), cast(LocalRenderer, _Side()))
    engine.on_call = renderer.recheck  # the instance restarts while it is being compared
    assert await renderer.check("m", "http://p0") is RenderCheck.PENDING
    engine.on_call = lambda: None
    assert await renderer.check("m", "http://p0") is RenderCheck.AGREES


def coercing_tokenize(body: dict[str, Any]) -> list[int]:
    """P's /tokenize, whose pydantic model coerces a tool's ``"strict": "true"`` to ``True``."""
    tools = [
        {**t, "function": {**t["function"], "strict": t["function"]["strict"] == "true"}}
        if "strict" in t["function"]
        else t
        for t in body.get("tools") or []
    ]
    return qwen3_tokenize({**body, "tools": tools or None})


@pytest.mark.parametrize("tokenize", [coercing_tokenize])
async def test_a_turn_this_process_cannot_render_as_vllm_does_is_rendered_by_the_engine(
    rig: Rig,
) -> None:
    await rig.until("agrees")
    calls = rig.fleet.tokenize_calls
    tools = [{"type": "function", "function": {"name": "f", "strict": "true"}}]
    ids = await rig.chat(1, tools=tools)
    assert rig.fleet.tokenize_calls == calls + 1  # declined here (router/render/messages.py)
    messages = [{"role": "user", "content": "question 1"}]
    assert ids == coercing_tokenize({"messages": messages, "tools": tools})


class _Refusing(_Side):
    """A side whose template raises on tools (as templates of models without tool support
    do), or on which this process declines them."""

    def __init__(self, refusal: Exception) -> None:
        super().__init__()
        self.refusal = refusal

    async def chat(self, body: dict[str, Any], model: str, engine_url: str | None) -> list[int]:
        if body.get("tools"):
            raise self.refusal
        return await super().chat(body, model, engine_url)


async def test_a_probe_both_sides_refuse_agrees() -> None:
    """A template that raises on some probes (role alternation, tool call ids, ...) raises
    for both: such a request is a 400 wherever it renders."""
    engine = _Refusing(ClientError("tools are not supported"))
    local = _Refusing(ClientError("chat template failed: tools are not supported"))
    renderer = AutoRenderer(cast(EngineTokenize, engine), cast(LocalRenderer, local))
    assert await renderer.check("m", "http://p0") is RenderCheck.AGREES


async def test_a_probe_only_this_process_refuses_disagrees() -> None:
    local = _Refusing(ClientError("chat template failed: tools are not supported"))
    renderer = AutoRenderer(cast(EngineTokenize, _Side()), cast(LocalRenderer, local))
    assert await renderer.check("m", "http://p0") is RenderCheck.DISAGREES


async def test_a_probe_this_process_declines_is_left_to_the_engine() -> None:
    local = _Refusing(RenderDeclined("the template reads the date (strftime_now)"))
    renderer = AutoRenderer(cast(EngineTokenize, _Side()), cast(LocalRenderer, local))
    assert await renderer.check("m", "http://p0") is RenderCheck.AGREES


class _DecliningChats(_Side):
    async def chat(self, body: dict[str, Any], model: str, engine_url: str | None) -> list[int]:
        raise RenderDeclined("the model has a processor, whose template vLLM may use")


async def test_no_chat_probe_compared_proves_nothing() -> None:
    renderer = AutoRenderer(cast(EngineTokenize, _Side()), cast(LocalRenderer, _DecliningChats()))
    assert await renderer.check("m", "http://p0") is RenderCheck.DISAGREES


TOOLS = [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}]


@pytest.mark.parametrize("backend", ["engine", "auto"])
@pytest.mark.parametrize("exclude", [True, False])
async def test_tool_choice_none_renders_without_tools_where_the_engines_exclude_them(
    exclude: bool, backend: str
) -> None:
    """vLLM started with --exclude-tools-when-tool-choice-none renders such a request without
    its tools, which /tokenize cannot show: the router is told so and does the same, whether
    P's /tokenize or this process renders."""
    p, d = FakeEngine("prefill", "p0:8000"), FakeEngine("decode", "d0:8000")
    flags = ["--prefill", p.url, "--decode", d.url, "--health-interval", "0.05"]
    flags += ["--render-backend", backend]
    flags += ["--exclude-tools-when-tool-choice-none"] if exclude else []
    fleet = FakeFleet(p, d, tokenize=qwen3_tokenize)
    app = create_app(load_config(flags, environ={}), transport=fleet, seed=0)
    async with AsyncTestClient(app=app) as client:
        rig = Rig(client, fleet, p)
        if backend == "auto":
            await rig.until("agrees")
        calls = fleet.tokenize_calls
        ids = await rig.chat(1, tools=TOOLS, tool_choice="none")
        assert fleet.tokenize_calls == calls + (backend == "engine")
        messages = [{"role": "user", "content": "question 1"}]
        assert ids == qwen3_tokenize({"messages": messages, "tools": None if exclude else TOOLS})
