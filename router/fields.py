"""What each field of an OpenAI request does to the ids P and D run, and so to reuse.

On a checked turn the router renders the prompt itself and hands P and D the exact ids it
checked (``kv_transfer_params.prompt_token_ids`` for chat, the prompt itself for completions).
vLLM then skips templating and tokenization (``vllm/renderers/online_renderer.py``,
``_reused_prompt_token_ids`` and ``preprocess_chat``, 0.33.0), so a field that shapes the
prompt must either be rendered by the router too or keep the router from checking at all.
The classes (``docs/request-fields.md`` has the table with each field's reason):

- ``PASSES``: sampling and output options; no effect on the prompt ids or their KV.
- ``RENDERED``: shapes the prompt; sent to the renderer with the messages. A renderer that
  cannot apply it makes the field ``DISABLES_REUSE`` for that turn.
- ``DISABLES_REUSE``: the engine must apply it itself (or the ids do not determine the KV:
  images, audio). The turn runs unchecked: no prompt ids forwarded, no handle attached, the
  stored handle released; what D ran is stored only when its ids determine its KV.
- ``REFUSED``: a 400; it would reach internal state or cannot work behind a P/D router.

A field this table does not know, and a content part whose type or keys it does not know,
make the turn unchecked too (``UNKNOWN_FIELD``, ``NON_TEXT_CONTENT``): a later vLLM may give
it a meaning that changes the ids or what they mean (a new kind of embeddings), and the
router cannot tell. Unknown costs reuse, never the KV's correctness.
"""

from __future__ import annotations

from collections.abc import Iterator
from enum import StrEnum
from typing import Any

__all__ = [
    "CHAT_FIELDS",
    "COMPLETION_FIELDS",
    "NON_TEXT_CONTENT",
    "UNKNOWN_FIELD",
    "FieldClass",
    "reuse_blockers",
]


class FieldClass(StrEnum):
    PASSES = "passes"
    RENDERED = "rendered"
    DISABLES_REUSE = "disables_reuse"
    REFUSED = "refused"


P = FieldClass.PASSES
R = FieldClass.RENDERED
D = FieldClass.DISABLES_REUSE
X = FieldClass.REFUSED

#: The condition name used when a message carries a non-text content part.
NON_TEXT_CONTENT = "non_text_content"
#: The condition name used when the request carries a field the table does not know.
UNKNOWN_FIELD = "unknown_field"

_SAMPLING_AND_OUTPUT: dict[str, FieldClass] = {
    "model": P,
    "frequency_penalty": P,
    "logit_bias": P,
    "logprobs": P,
    "max_tokens": P,
    "n": P,  # only 1 is accepted (router/openai.py)
    "presence_penalty": P,
    "response_format": P,
    "seed": P,
    "stop": P,
    "stream": P,
    "stream_options": P,
    "temperature": P,
    "top_p": P,
    "user": P,
    "top_k": P,
    "min_p": P,
    "repetition_penalty": P,
    "watermarking": P,
    "length_penalty": P,
    "stop_token_ids": P,
    "include_stop_str_in_output": P,
    "ignore_eos": P,
    "min_tokens": P,
    "skip_special_tokens": P,
    "spaces_between_special_tokens": P,
    "allowed_token_ids": P,
    "logprob_token_ids": P,
    "bad_words": P,
    "structured_outputs": P,
    "priority": P,
    "request_id": P,
    "session_id": P,
    "return_tokens_as_token_ids": P,
    "return_token_ids": P,  # set by the router; the client's choice decides what it sees
    "return_weight_versions": P,
    "routed_experts_prompt_start": P,
    "return_token_offsets": P,
    "vllm_xargs": P,
    "repetition_detection": P,
    "thinking_token_budget": P,
    "stream_interval": P,
    # Salts only the prefix-cache hashes; the KV values, and so a handle's, do not depend on it.
    "cache_salt": P,
    # vLLM truncates to the last (or first) k ids; tokenization is skipped for forwarded ids.
    "truncate_prompt_tokens": D,
    "truncation_side": D,
    # Prompt logprobs need the prompt's logits, which a pulled prefix never computes.
    "prompt_logprobs": D,
    "mm_payload": D,
    "return_mm_kwargs": D,
    "kv_transfer_params": X,  # would read other conversations' KV
    "ec_transfer_params": X,  # encoder-cache transfer: internal to a disaggregated deployment
    "use_beam_search": X,  # beam search fans out one request; P/D legs carry one sequence
}

CHAT_FIELDS: dict[str, FieldClass] = {
    **_SAMPLING_AND_OUTPUT,
    "messages": R,
    "tools": R,
    "chat_template": R,
    "chat_template_kwargs": R,
    "add_generation_prompt": R,
    "continue_final_message": R,
    "add_special_tokens": R,
    "documents": R,
    # Mapped to template kwargs inside vLLM's chat serving (reasoning_effort_map).
    "reasoning_effort": R,
    # Changes the prompt only under --exclude-tools-when-tool-choice-none (not supported).
    "tool_choice": P,
    "parallel_tool_calls": P,
    "include_reasoning": P,
    "top_logprobs": P,
    "max_completion_tokens": P,
    "return_prompt_text": P,
    # vLLM ignores forwarded ids under echo and renders the messages instead.
    "echo": D,
    "media_io_kwargs": D,
    "mm_processor_kwargs": D,
}

COMPLETION_FIELDS: dict[str, FieldClass] = {
    **_SAMPLING_AND_OUTPUT,
    "prompt": R,
    # A token-id prompt is sent as it is; only a text prompt is tokenized (with this flag).
    "add_special_tokens": D,
    "echo": P,  # the prompt ids are run as checked; echo only returns them
    "suffix": D,
    "prompt_embeds": D,
}

# Values that are the endpoint's own default change nothing.
_DEFAULTS: dict[str, Any] = {
    "echo": False,
    "add_generation_prompt": True,
    "continue_final_message": False,
    "truncate_prompt_tokens": None,
    "prompt_logprobs": None,
    "use_beam_search": False,
}
_CHAT_DEFAULTS = {**_DEFAULTS, "add_special_tokens": False}
_COMPLETION_DEFAULTS = {**_DEFAULTS, "add_special_tokens": True}


def _set_fields(body: dict[str, Any], chat: bool) -> Iterator[tuple[str, FieldClass | None]]:
    """The body's fields whose value is not the endpoint's default, with their class (``None``:
    a field the table does not know); a walk over the few keys a request has."""
    table = CHAT_FIELDS if chat else COMPLETION_FIELDS
    defaults = _CHAT_DEFAULTS if chat else _COMPLETION_DEFAULTS
    for name, value in body.items():
        if value is None or (name in defaults and value == defaults[name]):
            continue
        yield name, table.get(name)


def refused_field(body: dict[str, Any], *, chat: bool) -> str | None:
    """The first field this request may not carry, if any."""
    return next((n for n, kind in _set_fields(body, chat) if kind is FieldClass.REFUSED), None)


def reuse_blockers(body: dict[str, Any], *, chat: bool, renders: frozenset[str]) -> list[str]:
    """Fields (and conditions) of this request that keep the router from checking its ids:
    ``DISABLES_REUSE`` fields that are set, ``RENDERED`` fields the renderer cannot apply,
    fields the table does not know (one ``UNKNOWN_FIELD``: a client's names never become
    metric labels), and content parts that are not surely text. Empty when the turn can be
    checked."""
    found: list[str] = []
    unknown = False
    for name, kind in _set_fields(body, chat):
        if kind is None:
            unknown = True
        elif kind is FieldClass.DISABLES_REUSE or (
            kind is FieldClass.RENDERED and name not in renders
        ):
            found.append(name)
    if unknown:
        found.append(UNKNOWN_FIELD)
    if chat and _has_non_text_content(body.get("messages")):
        found.append(NON_TEXT_CONTENT)
    return found


# A content part is text only when its type is one vLLM parses as text and every key it
# carries is one of those types' own (vLLM 0.33 renderers/chat_utils.py, MM_PARSER_MAP and
# TEXT_PART_TYPES): any other type or key, including those a later vLLM adds, is treated as
# media. A part without a type is text only with a ``text`` key alone (vLLM infers the
# type of an untyped part from its keys, ``_parse_chat_message_content_mm_part``).
_TEXT_PART_KEYS: dict[str, frozenset[str]] = {
    "text": frozenset({"type", "text"}),
    "input_text": frozenset({"type", "text"}),
    "output_text": frozenset({"type", "text"}),
    "refusal": frozenset({"type", "refusal"}),
    "thinking": frozenset({"type", "thinking", "closed"}),
    "tool_reference": frozenset({"type", "name"}),
}
_UNTYPED_TEXT = frozenset({"text"})
#: Message keys whose values never carry media (anything else makes the message media).
_MESSAGE_KEYS = frozenset(
    {
        "role",
        "content",
        "name",
        "tool_calls",
        "tool_call_id",
        "reasoning",
        "reasoning_content",
        "function_call",
        "refusal",
    }
)


def _is_text_part(part: Any) -> bool:
    if not isinstance(part, dict):
        return False
    kind = part.get("type")
    if kind is None:
        return part.keys() == _UNTYPED_TEXT
    allowed = _TEXT_PART_KEYS.get(kind) if isinstance(kind, str) else None
    return allowed is not None and part.keys() <= allowed


def _has_non_text_content(messages: Any) -> bool:
    if not isinstance(messages, list):
        return False
    for message in messages:
        if not isinstance(message, dict):
            continue
        if not message.keys() <= _MESSAGE_KEYS:
            return True
        for field in ("reasoning", "reasoning_content"):
            value = message.get(field)
            if value is not None and not isinstance(value, str):
                return True  # prompt embeddings in place of reasoning text, or what is unknown
        content = message.get("content")
        if isinstance(content, list) and not all(_is_text_part(part) for part in content):
            return True
    return False
