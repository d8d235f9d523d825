"""Where prompt token ids come from: the P instance's ``/tokenize``, vLLM's render server, or a
tokenizer and chat template in this process (run in a thread). The default combines the first
and the last (router/render/auto.py)."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any, Protocol

from tokenizers import Tokenizer

from carryover.router.config import RenderConfig
from carryover.router.engines.upstream import Upstream
from carryover.router.errors import ClientError, EngineFailed, UpstreamError
from carryover.router.render.chat_template import ChatTemplate, bundled_qwen3_dir
from carryover.router.render.context import PromptTooLong
from carryover.router.render.errors import RenderDeclined, RenderFailed, RenderInputError
from carryover.router.render.spans import SPAN_CHARS

log = logging.getLogger("carryover.render")

__all__ = [
    "LOCAL_FIELDS",
    "TOKENIZE_FIELDS",
    "EngineTokenize",
    "LocalRenderer",
    "RenderDeclined",
    "RenderFailed",
    "Renderer",
    "local_folder",
]

# Fields of a chat request that change what the template renders, as each backend takes
# them: P's /tokenize (vLLM's TokenizeChatRequest has no documents or reasoning_effort), the
# render server (a whole ChatCompletionRequest), this process's template. A field one cannot
# apply keeps the turn unchecked (router/fields.py).
TOKENIZE_FIELDS = frozenset(
    {
        "messages",
        "tools",
        "chat_template",
        "chat_template_kwargs",
        "add_generation_prompt",
        "continue_final_message",
        "add_special_tokens",
    }
)
RENDER_SERVER_FIELDS = TOKENIZE_FIELDS | {"documents", "reasoning_effort"}
LOCAL_FIELDS = frozenset({"messages", "tools", "chat_template_kwargs", "add_generation_prompt"})


def _ids(value: Any) -> list[int]:
    if (
        isinstance(value, list)
        and value
        and all(isinstance(i, int) and not isinstance(i, bool) for i in value)
    ):
        return value
    raise RenderFailed("render backend answered without token ids")


class Renderer(Protocol):
    #: the chat request fields this backend applies when it renders
    renders: frozenset[str]

    async def chat(
        self,
        body: dict[str, Any],
        model: str,
        engine_url: str | None,
        *,
        size: int = 0,
        max_model_len: int | None = None,
    ) -> list[int]:
        """Token ids of a chat request's prompt. ``engine_url``: a P instance to ask, if any;
        ``size``: the request body's bytes (0: not known), a bound on all it renders;
        ``max_model_len``: the model's context, if known: a renderer in this process refuses
        a longer prompt before its ids exist (``context.py``; engines refuse it themselves)."""
        ...

    async def text(
        self, prompt: str, model: str, engine_url: str | None, *, max_model_len: int | None = None
    ) -> list[int]: ...

    async def warm(self, body: dict[str, Any], answer: str) -> None:
        """Prepare for the next turn of the chat request ``body``, whose answer was ``answer``
        (a renderer in this process tokenizes the answer's span now, off the next turn's
        path; the others do nothing). Never raises: it runs in the background, and a warm-up
        that fails costs the next turn's speed only."""
        ...


class EngineTokenize:
    renders = TOKENIZE_FIELDS

    def __init__(self, upstream: Upstream, timeout: float) -> None:
        self._upstream = upstream
        self._timeout = timeout

    async def _call(self, url: str, body: dict[str, Any], field: str) -> list[int]:
        """POST to a render endpoint and take the ids from ``field`` of its answer."""
        try:
            answer = await self._upstream.post_json(url, body, timeout=self._timeout)
        except EngineFailed as exc:
            if exc.upstream_status is not None and 400 <= exc.upstream_status < 500:
                raise ClientError(exc.message) from exc  # the request itself cannot render
            raise RenderFailed(exc.message) from exc
        except UpstreamError as exc:
            raise RenderFailed(exc.message) from exc
        return _ids(answer.get(field) if isinstance(answer, dict) else None)

    async def _post(self, url: str | None, body: dict[str, Any]) -> list[int]:
        if url is None:
            raise RenderFailed("no prefill instance to tokenize with")
        return await self._call(f"{url}/tokenize", body, "tokens")

    async def chat(
        self,
        body: dict[str, Any],
        model: str,
        engine_url: str | None,
        *,
        size: int = 0,
        max_model_len: int | None = None,
    ) -> list[int]:
        request = {k: body[k] for k in self.renders if k in body}
        request.setdefault("add_generation_prompt", True)
        request["model"] = model
        return await self._post(engine_url, request)

    async def text(
        self, prompt: str, model: str, engine_url: str | None, *, max_model_len: int | None = None
    ) -> list[int]:
        return await self._post(engine_url, {"model": model, "prompt": prompt})

    async def warm(self, body: dict[str, Any], answer: str) -> None:
        return None


class RenderServer(EngineTokenize):
    """vLLM's ``/v1/chat/completions/render`` (a ``vllm launch render`` server)."""

    renders = RENDER_SERVER_FIELDS

    def __init__(self, upstream: Upstream, url: str, timeout: float) -> None:
        super().__init__(upstream, timeout)
        self._url = url.rstrip("/")

    async def chat(
        self,
        body: dict[str, Any],
        model: str,
        engine_url: str | None,
        *,
        size: int = 0,
        max_model_len: int | None = None,
    ) -> list[int]:
        request = {k: body[k] for k in self.renders if k in body}
        request["model"] = model
        return await self._call(f"{self._url}/v1/chat/completions/render", request, "token_ids")

    async def text(
        self, prompt: str, model: str, engine_url: str | None, *, max_model_len: int | None = None
    ) -> list[int]:
        return await super().text(prompt, model, self._url)


class LocalRenderer:
    renders = LOCAL_FIELDS

    def __init__(self, folder: Path, span_chars: int = SPAN_CHARS) -> None:
        self._template = ChatTemplate(folder, fast_spans=True, span_chars=span_chars)

    @property
    def tokenizer(self) -> Tokenizer:
        return self._template.tokenizer

    def _render(self, body: dict[str, Any], max_model_len: int | None) -> list[int]:
        try:
            return self._template.render(
                body["messages"],
                add_generation_prompt=bool(body.get("add_generation_prompt", True)),
                tools=body.get("tools"),
                chat_template_kwargs=body.get("chat_template_kwargs") or {},
                max_model_len=max_model_len,
            )
        except PromptTooLong as exc:
            raise ClientError(str(exc), param=exc.param) from exc
        except RenderInputError as exc:
            raise ClientError(str(exc)) from exc

    def _encode_prompt(self, prompt: str, max_model_len: int | None) -> list[int]:
        try:
            return self._template.encode_prompt(prompt, max_model_len)
        except PromptTooLong as exc:
            raise ClientError(str(exc), param=exc.param) from exc

    async def chat(
        self,
        body: dict[str, Any],
        model: str,
        engine_url: str | None,
        *,
        size: int = 0,
        max_model_len: int | None = None,
    ) -> list[int]:
        if size < INLINE_BYTES and _text_size(body.get("messages")) < INLINE_CHARS:
            return self._render(body, max_model_len)
        return await asyncio.to_thread(self._render, body, max_model_len)

    async def text(
        self, prompt: str, model: str, engine_url: str | None, *, max_model_len: int | None = None
    ) -> list[int]:
        if len(prompt) < INLINE_CHARS:
            return self._encode_prompt(prompt, max_model_len)
        return await asyncio.to_thread(self._encode_prompt, prompt, max_model_len)

    async def warm(self, body: dict[str, Any], answer: str) -> None:
        kwargs = body.get("chat_template_kwargs") or {}
        try:
            if len(answer) < INLINE_CHARS:
                self._template.warm(answer, kwargs)
            else:
                await asyncio.to_thread(self._template.warm, answer, kwargs)
        except Exception:  # a warm-up that fails costs the next turn's speed only
            log.debug("render warm-up failed", exc_info=True)


#: Below this many characters of message text a render runs on the event loop: a 200-token
#: chat renders in about 0.1 ms, less than the hop to a worker thread and back costs
#: (``bench/RESULTS.md``). Longer ones go to a thread, so that a 10k-token prompt's few ms
#: of tokenizing (its new spans) do not hold up every other turn.
INLINE_CHARS = 4096
#: Nor a body larger than this: what else it renders (tools, tool calls' arguments) counts
#: too, and a 10 MB tools list rendered on the loop held every other turn for 0.33 s.
INLINE_BYTES = 16 * 1024


def _text_size(messages: Any) -> int:
    """Characters of text in ``messages`` (what tokenizing costs grows with); a shape the
    template will refuse counts as large, so its error is raised in the thread."""
    if not isinstance(messages, list):
        return INLINE_CHARS
    size = 0
    for message in messages:
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, str):
            size += len(content)
        elif content is not None:
            size += INLINE_CHARS  # parts: count as large rather than walk them
    return size


def local_folder(config: RenderConfig) -> Path:
    """The tokenizer files to render with in process (the bundled Qwen3 files by default)."""
    return Path(config.path) if config.path else bundled_qwen3_dir()
