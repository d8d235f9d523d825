"""Does the render server behave as the model's configuration says? (docs/tokens-pipeline.md)

A render server with another chat template or other parsers than the deployment expects
splits content, reasoning and tool calls differently, or renders other ids, and no call
fails. So before a tokens-only model serves, the router asks the server: the model it
serves, how it derenders a reasoning block and a tool call (derender of known ids, against
the configured parsers), and, when ``render.path`` names the template's files, how it renders
the probe chats the default renderer is checked with. A mismatch keeps the model refusing
turns (503 with the reason) and ``/ready`` false, until a later check passes; so does a
server not checked yet.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from enum import StrEnum
from typing import Any

from carryover.router.config import ModelConfig
from carryover.router.errors import CarryoverError
from carryover.router.render.auto import probe_chats
from carryover.router.render.backends import LocalRenderer, local_folder
from carryover.router.tokens.detok import Vocabulary
from carryover.router.tokens.server import RenderServerClient

__all__ = ["ServerCheck", "TokensCheck", "check_render_server", "keep_checking", "load_local"]

log = logging.getLogger("carryover.tokens")

# Output formats the probes speak: Qwen3/DeepSeek-R1 reasoning blocks and Hermes tool calls
# (the formats of the parsers vLLM names qwen3, deepseek_r1 and hermes).
_THINK_PARSERS = frozenset({"qwen3", "deepseek_r1"})
_HERMES_PARSERS = frozenset({"hermes"})
_THINK_TEXT = "<think>\nprobe reasoning\n</think>\n\nprobe answer"
_TOOL_TEXT = '<tool_call>\n{"name": "probe", "arguments": {"id": 7}}\n</tool_call>'
_PROBE_TOOL = {
    "type": "function",
    "function": {
        "name": "probe",
        "parameters": {"type": "object", "properties": {"id": {"type": "integer"}}},
    },
}


class ServerCheck(StrEnum):
    PENDING = "pending"  #: not reached yet
    AGREES = "agrees"
    MISMATCH = "mismatch"


class TokensCheck:
    """One tokens-only model's verdict on its render server."""

    def __init__(self) -> None:
        self.state = ServerCheck.PENDING
        self.problems: list[str] = []
        # This process's tokenizer, once it tokenized the probes as the server does: streams
        # no parser needs to see are then detokenized here (router/tokens/detok.py).
        self.vocabulary: Vocabulary | None = None

    @property
    def refusal(self) -> str | None:
        """Why turns are refused now; ``None`` once the server matched."""
        if self.state is ServerCheck.AGREES:
            return None
        if self.state is ServerCheck.PENDING:
            return "the render server has not been checked yet (is it up?)"
        return "the render server does not match this model's configuration: " + "; ".join(
            self.problems
        )


def _reasoning_of(message: dict[str, Any]) -> str | None:
    value = message.get("reasoning") or message.get("reasoning_content")
    return value if isinstance(value, str) and value else None


async def _derender_text(
    server: RenderServerClient, model: str, text: str, request: dict[str, Any]
) -> dict[str, Any]:
    tokenized = await server.post("/tokenize", {"model": model, "prompt": text})
    ids = tokenized.get("tokens") if isinstance(tokenized, dict) else None
    if not isinstance(ids, list):
        raise ValueError("the render server's /tokenize answered without tokens")
    generated = {
        "request_id": "generate-tokens-probe",
        "model": model,
        "created": 0,
        "output_mode": "tokens",
        "usage": {"prompt_tokens": 1, "completion_tokens": len(ids), "total_tokens": 0},
        "choices": [{"index": 0, "finish_reason": "stop", "token_ids": ids, "logprobs": None}],
    }
    answer = await server.derender(generated, 1, {"model": model, **request}, chat=True)
    message = answer["choices"][0]["message"]
    return message if isinstance(message, dict) else {}


async def check_render_server(
    server: RenderServerClient, model: ModelConfig, name: str, local: LocalRenderer | None
) -> list[str]:
    """What differs (empty: nothing). ``local``: the files of ``render.path`` (or the bundled
    ones), loaded once. Raises ``CarryoverError`` when the server is not reachable, to be
    tried again."""
    problems: list[str] = []
    listed = await server.get_json("/v1/models")
    served = [m.get("id") for m in listed.get("data", ())] if isinstance(listed, dict) else []
    if name not in served:
        problems.append(f"it serves {served}, not {name!r}")
        return problems
    settings = model.tokens
    user = {"messages": [{"role": "user", "content": "probe"}]}
    message = await _derender_text(server, name, _THINK_TEXT, user)
    reasoning = _reasoning_of(message)
    if settings.reasoning_parser is None and reasoning is not None:
        problems.append(
            "it has a reasoning parser, the configuration none (tokens.reasoning_parser)"
        )
    elif settings.reasoning_parser in _THINK_PARSERS and reasoning is None:
        problems.append(f"it does not parse reasoning as {settings.reasoning_parser} would")
    tools = {**user, "tools": [_PROBE_TOOL]}
    try:
        message = await _derender_text(server, name, _TOOL_TEXT, tools)
        calls = message.get("tool_calls") or []
    except CarryoverError as exc:
        if settings.tool_call_parser is not None:
            problems.append(f"it refuses a request with tools ({exc.message})")
        calls = []
    if settings.tool_call_parser is None and calls:
        problems.append(
            "it has a tool-call parser, the configuration none (tokens.tool_call_parser)"
        )
    elif settings.tool_call_parser in _HERMES_PARSERS and not calls:
        problems.append(f"it does not parse tool calls as {settings.tool_call_parser} would")
    if model.render.path:
        if local is None:
            problems.append(f"{model.render.path} holds no chat template this process can read")
            return problems
        for number, chat in enumerate(probe_chats()):
            ours = await local.chat(chat, name, None)
            theirs = (await server.render({"model": name, **chat}, chat=True))["token_ids"]
            if ours != theirs:
                problems.append(
                    f"its chat template renders probe {number} unlike {model.render.path}"
                )
                break
    return problems


_TOKENIZER_PROBES = [
    "plain text  with  spaces, ünïcode and 12345",
    "<|im_start|>user\n日本語も。 emoji 🙂 tabs\t<|im_end|>\n<think>\n</think>",
]


def load_local(model: ModelConfig) -> LocalRenderer | None:
    """The tokenizer and template of ``render.path`` (the bundled Qwen3 files by default),
    parsed once per model; ``None`` when they cannot be read."""
    try:
        return LocalRenderer(local_folder(model.render), model.render.span_cache_chars)
    except Exception as exc:  # tokenizers raises bare Exceptions on unreadable files
        log.info("no tokenizer in process for %s: %s", model.name or "a tokens-only model", exc)
        return None


async def tokenizer_agrees(server: RenderServerClient, local: LocalRenderer, name: str) -> bool:
    """Whether ``local``'s tokenizer gives the server's ids on the probes (if not, the
    server derenders every stream)."""
    for probe in _TOKENIZER_PROBES:
        answer = await server.post("/tokenize", {"model": name, "prompt": probe})
        theirs = answer.get("tokens") if isinstance(answer, dict) else None
        if await local.text(probe, name, None) != theirs:
            log.info("this process's tokenizer differs from the render server's for %s", name)
            return False
    return True


async def keep_checking(
    check: TokensCheck,
    server: RenderServerClient,
    model: ModelConfig,
    name: Callable[[], str | None],
    *,
    retry: float,
    interval: float,
) -> None:
    """Check until cancelled: every ``retry`` seconds while the server cannot be reached,
    every ``interval`` once it answered (a redeployed render server may differ)."""
    local = await asyncio.to_thread(load_local, model)
    vocabulary = Vocabulary.of(local.tokenizer) if local is not None else None
    while True:
        served = name()
        if served is None:
            await asyncio.sleep(retry)
            continue
        try:
            problems = await check_render_server(server, model, served, local)
        except (CarryoverError, ValueError, KeyError, IndexError, TypeError) as exc:
            log.info("render server check of %s not possible yet: %s", served, exc)
            await asyncio.sleep(retry)
            continue
        try:
            agrees = local is not None and await tokenizer_agrees(server, local, served)
        except CarryoverError:
            agrees = False
        check.vocabulary = vocabulary if agrees else None
        state = ServerCheck.MISMATCH if problems else ServerCheck.AGREES
        if state is not check.state or problems != check.problems:
            check.state, check.problems = state, problems
            if problems:
                log.error("%s", check.refusal)
            else:
                log.info("render server %s matches the configuration of %s", server.url, served)
        await asyncio.sleep(interval)
