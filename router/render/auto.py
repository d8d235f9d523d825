"""The default renderer: this process's tokenizer and chat template, once they agree with the
engine's ``/tokenize`` on probe prompts; the engine's ``/tokenize`` until then, and for good
when they disagree.

Rendering in process takes the tokenization off every turn's path (docs/rendering.md), but a
template or tokenizer that differs from the engine's by one id would make every stored prefix
miss, or worse, make the router check ids the engine never runs. So nothing is rendered
locally before the engine has said the same ids for the probes, and the probe runs again
whenever a prefill instance restarts (a new deployment may bring another tokenizer).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from enum import StrEnum
from functools import partial
from typing import Any

from carryover.router.errors import ClientError
from carryover.router.render.backends import (
    LOCAL_FIELDS,
    TOKENIZE_FIELDS,
    EngineTokenize,
    LocalRenderer,
)
from carryover.router.render.errors import RenderDeclined, RenderFailed

__all__ = ["AutoRenderer", "RenderCheck", "keep_checked", "probe_chats", "probe_texts"]

log = logging.getLogger("carryover.render")

_Render = Callable[[], Awaitable[list[int]]]


@dataclass(frozen=True)
class _Probe:
    name: str
    chat: bool  # a chat request (else a text prompt)
    here: _Render
    there: _Render


# Fields /tokenize applies and the local template does not: such a request goes to the engine.
_ENGINE_ONLY = TOKENIZE_FIELDS - LOCAL_FIELDS


class RenderCheck(StrEnum):
    """Where the default renderer stands."""

    PENDING = "pending"  #: not compared yet: the engine renders
    AGREES = "agrees"  #: same ids on every probe: this process renders
    DISAGREES = "disagrees"  #: the engine renders until a prefill instance restarts
    NO_LOCAL = "no_local"  #: no tokenizer or template loaded here: the engine renders


def probe_chats() -> list[dict[str, Any]]:
    """Chat requests whose rendering exercises what templates differ on: a system prompt,
    tools (JSON layout), an earlier assistant turn with reasoning (dropped or kept), an
    empty message, non-ASCII text, thinking switched off, and what vLLM prepares before
    templating (tool calls, reasoning fields, content part types)."""
    tools = [
        {
            "type": "function",
            "function": {
                "name": "lookup",
                "description": 'Find a record (ünïcode, "quotes").',
                "parameters": {
                    "type": "object",
                    "properties": {"id": {"type": "integer"}, "tag": {"type": "string"}},
                    "required": ["id"],
                },
            },
        }
    ]
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "You are terse.\n  Keep  spacing."},
        {"role": "user", "content": "Hello — what is 2+2? 日本語も。"},
        {"role": "assistant", "content": "<think>\nsimple sum\n</think>\n\n4."},
        {"role": "user", "content": ""},
        {"role": "assistant", "content": "Anything else?"},
        {"role": "user", "content": [{"type": "text", "text": "Look up 7, please.\t"}]},
    ]
    # An agent loop after the last user message, as vLLM prepares it before templating
    # (router/render/messages.py): tool-call arguments compact and spaced (parsed, then
    # written with json.dumps spacing), reasoning, tool results, the text part types vLLM's
    # request model takes for these roles, empty parts skipped. (Not reasoning_content: the
    # chat request renames it to reasoning, /tokenize's does not.)
    agent: list[dict[str, Any]] = [
        messages[0],
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "Find 7."},
                {"type": "text", "text": ""},
                {"type": "thinking", "thinking": "a record"},
                {"type": "refusal", "refusal": "or not"},
            ],
        },
        {
            "role": "assistant",
            "content": "",
            "reasoning": "look it up",
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "lookup", "arguments": '{"id":7,"tag":"ä"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": '{"found": true}'},
        {
            "role": "assistant",
            "content": "Checking twice.",
            "tool_calls": [
                {
                    "id": "call_2",
                    "type": "function",
                    "function": {"name": "lookup", "arguments": '{"id": 7, "tag": "b"}'},
                }
            ],
        },
        {
            "role": "tool",
            "tool_call_id": "call_2",
            "content": [{"type": "text", "text": "same"}, {"type": "text", "text": "again"}],
        },
    ]
    return [
        {"messages": messages, "tools": tools, "add_generation_prompt": True},
        {"messages": agent, "tools": tools, "add_generation_prompt": True},
        {
            "messages": messages[:3],
            "add_generation_prompt": False,
            "chat_template_kwargs": {"enable_thinking": False},
        },
        {"messages": messages[-1:], "chat_template_kwargs": {"enable_thinking": False}},
        # A developer message after the system one: a template that does not name the role
        # gets one system message (vLLM's rule, router/render/messages.py).
        {
            "messages": [
                messages[0],
                {"role": "user", "content": "Hi."},
                {"role": "developer", "content": "Answer in French."},
                {"role": "user", "content": "Bye."},
            ]
        },
    ]


def probe_texts() -> list[str]:
    """Completions prompts with the added tokens of the families in docs/rendering.md (text
    to a tokenizer that does not have them) and text at the start, where a tokenizer may
    add a BOS token or mark the first word."""
    return [
        "<|im_start|>user\nplain text  with  spaces, ünïcode and 12345<|im_end|>\n",
        "Start here <s>[INST] in turn [/INST] answer</s>\n[TOOL_CALLS] 日本語 <|endoftext|>",
    ]


#: Seconds between looks for P and the model's name while neither the check nor the
#: health probes have run (two lookups in this process, no request).
_UNKNOWN_POLL = 0.2


class AutoRenderer:
    # What a request may carry and still be rendered (by one side or the other).
    renders = TOKENIZE_FIELDS

    def __init__(
        self,
        engine: EngineTokenize,
        local: LocalRenderer | None,
        *,
        on_change: Callable[[RenderCheck], None] = lambda _: None,
    ) -> None:
        self._engine = engine
        self._local = local
        self._on_change = on_change
        self.state = RenderCheck.PENDING if local is not None else RenderCheck.NO_LOCAL
        self._rechecks = 0  # a check that overlapped a restart does not count
        on_change(self.state)

    def _set(self, state: RenderCheck) -> None:
        if state is not self.state:
            self.state = state
            self._on_change(state)

    def _local_for(self, body: dict[str, Any]) -> LocalRenderer | None:
        if self.state is not RenderCheck.AGREES or any(f in body for f in _ENGINE_ONLY):
            return None
        return self._local

    async def chat(
        self,
        body: dict[str, Any],
        model: str,
        engine_url: str | None,
        *,
        size: int = 0,
        max_model_len: int | None = None,
    ) -> list[int]:
        local = self._local_for(body)
        if local is not None:
            try:
                return await local.chat(
                    body, model, engine_url, size=size, max_model_len=max_model_len
                )
            except RenderDeclined:
                pass  # what vLLM's preprocessing would do here is not reproduced: ask it
        return await self._engine.chat(body, model, engine_url)

    async def text(
        self, prompt: str, model: str, engine_url: str | None, *, max_model_len: int | None = None
    ) -> list[int]:
        if self.state is RenderCheck.AGREES and self._local is not None:
            return await self._local.text(prompt, model, engine_url, max_model_len=max_model_len)
        return await self._engine.text(prompt, model, engine_url)

    async def warm(self, body: dict[str, Any], answer: str) -> None:
        local = self._local_for(body)
        if local is not None:
            await local.warm(body, answer)

    def recheck(self) -> None:
        """A prefill instance restarted: render through the engine until compared again."""
        if self.state is not RenderCheck.NO_LOCAL:
            self._rechecks += 1
            self._set(RenderCheck.PENDING)

    async def check(self, model: str, engine_url: str) -> RenderCheck:
        """Compare both sides on the probes; ``PENDING`` again when the engine could not
        be reached (the caller tries later)."""
        local = self._local
        if local is None:
            return self.state
        engine, started = self._engine, self._rechecks
        probes = [
            _Probe(
                f"chat probe {number}",
                True,
                partial(local.chat, body, model, None),
                partial(engine.chat, body, model, engine_url),
            )
            for number, body in enumerate(probe_chats())
        ]
        probes += [
            _Probe(
                "text probe",
                False,
                partial(local.text, text, model, None),
                partial(engine.text, text, model, engine_url),
            )
            for text in probe_texts()
        ]
        verdict = await self._compare(probes, engine_url)
        if verdict is None or self._rechecks != started:
            return self.state  # not reached yet, or an instance restarted meanwhile: again
        if verdict is RenderCheck.AGREES and self.state is not RenderCheck.AGREES:
            log.info("rendering in process: it agrees with %s/tokenize", engine_url)
        self._set(verdict)
        return self.state

    async def _compare(self, probes: list[_Probe], engine_url: str) -> RenderCheck | None:
        """``AGREES``, ``DISAGREES`` (logged), or ``None`` when the engine was not reached.

        A chat probe both sides refuse (a template that raises on a system message or on a
        tool call's id, say) agrees: such a request is a 400 either way. A chat probe this
        process declines (:class:`RenderDeclined`) proves nothing and is skipped: requests of
        its shape go to the engine anyway. At least one chat probe and every text probe must
        give the same ids."""
        compared_chats = 0
        for probe in probes:
            try:
                ours: list[int] | None = await probe.here()
            except RenderDeclined as exc:
                if not probe.chat:
                    return self._give_up(f"{probe.name}: this process cannot render it ({exc})")
                log.info("render check: %s is rendered by the engine (%s)", probe.name, exc)
                continue
            except ClientError as exc:
                if not probe.chat:
                    return self._give_up(f"{probe.name}: this process refused it ({exc})")
                ours = None
            except RenderFailed as exc:
                return self._give_up(f"{probe.name}: this process cannot render it ({exc})")
            try:
                theirs = await probe.there()
            except ClientError as exc:
                if ours is not None:
                    return self._give_up(f"{probe.name}: the engine refused it ({exc})")
                continue  # refused on both sides
            except RenderFailed as exc:
                log.info("render check against %s not possible yet: %s", engine_url, exc)
                return None
            if ours is None:
                return self._give_up(f"{probe.name}: this process refused it, the engine did not")
            if ours != theirs:
                return self._disagree(probe.name, ours, theirs)
            compared_chats += probe.chat
        if not compared_chats:
            return self._give_up("no chat probe gave ids on both sides")
        return RenderCheck.AGREES

    @staticmethod
    def _give_up(why: str) -> RenderCheck:
        log.warning("render check failed, the engine renders: %s", why)
        return RenderCheck.DISAGREES

    @staticmethod
    def _disagree(probe: str, ours: list[int], theirs: list[int]) -> RenderCheck:
        at = next(
            (i for i, (a, b) in enumerate(zip(ours, theirs, strict=False)) if a != b),
            min(len(ours), len(theirs)),
        )
        log.warning(
            "the local tokenizer or chat template differs from the engine's (%s: %d against "
            "%d ids, first difference at id %d: %s against %s); the engine renders",
            probe,
            len(ours),
            len(theirs),
            at,
            ours[at : at + 4],
            theirs[at : at + 4],
        )
        return RenderCheck.DISAGREES


async def keep_checked(
    renderer: AutoRenderer,
    model_name: Callable[[], str | None],
    prefill_url: Callable[[], str | None],
    interval: float,
) -> None:
    """Run ``renderer.check`` whenever it is pending and a prefill instance and the model's
    name are known; runs until cancelled. Until they are known (the first health probe brings
    the name), it looks again every ``_UNKNOWN_POLL`` seconds, not every ``interval``: each
    chat turn is rendered by P meanwhile."""
    while renderer.state is not RenderCheck.NO_LOCAL:
        if renderer.state is RenderCheck.PENDING:
            name, url = model_name(), prefill_url()
            if name is None or url is None:
                await asyncio.sleep(min(interval, _UNKNOWN_POLL))
                continue
            await renderer.check(name, url)
        await asyncio.sleep(interval)
