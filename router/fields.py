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

Fields vLLM does not know pass through (vLLM ignores them).
"""

from __future__ import annotations

from collections.abc import Iterator
from enum import StrEnum
from typing import Any

__all__ = [
    "CHAT_FIELDS",
    "COMPLETION_FIELDS",
    "NON_TEXT_CONTENT",
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


def _set_fields(body: dict[str, Any], chat: bool) -> Iterator[tuple[str, FieldClass]]:
    """The body's known fields whose value is not the endpoint's default, with their class
    (a walk over the few keys a request has, not over the table)."""
    table = CHAT_FIELDS if chat else COMPLETION_FIELDS
    defaults = _CHAT_DEFAULTS if chat else _COMPLETION_DEFAULTS
    for name, value in body.items():
        kind = table.get(name)
        if kind is None or value is None or (name in defaults and value == defaults[name]):
            continue
        yield name, kind


def refused_field(body: dict[str, Any], *, chat: bool) -> str | None:
    """The first field this request may not carry, if any."""
    return next((n for n, kind in _set_fields(body, chat) if kind is FieldClass.REFUSED), None)


def reuse_blockers(body: dict[str, Any], *, chat: bool, renders: frozenset[str]) -> list[str]:
    """Fields (and conditions) of this request that keep the router from checking its ids:
    ``DISABLES_REUSE`` fields that are set, ``RENDERED`` fields the renderer cannot apply,
    and non-text content parts. Empty when the turn can be checked."""
    found = [
        name
        for name, kind in _set_fields(body, chat)
        if kind is FieldClass.DISABLES_REUSE
        or (kind is FieldClass.RENDERED and name not in renders)
    ]
    if chat and _has_non_text_content(body.get("messages")):
        found.append(NON_TEXT_CONTENT)
    return found


# As vLLM 0.33 tells text from media (renderers/chat_utils/chat_message.py,
# has_non_text_content): a part is media when its type is not a text type, or when it
# carries a media key whatever its type.
_TEXT_PART_TYPES = frozenset(
    {"text", "input_text", "output_text", "refusal", "thinking", "tool_reference"}
)
_MEDIA_KEYS = frozenset(
    {
        "image_url",
        "image_embeds",
        "image_pil",
        "image",
        "input_audio",
        "audio_url",
        "audio_embeds",
        "audio",
        "video_url",
        "video",
        "file",
    }
)


def _has_non_text_content(messages: Any) -> bool:
    if not isinstance(messages, list):
        return False
    for message in messages:
        if not isinstance(message, dict):
            continue
        for field in ("reasoning", "reasoning_content"):
            value = message.get(field)
            if isinstance(value, dict) and value.get("type") == "prompt_embeds":
                return True
        content = message.get("content")
        if not isinstance(content, list):
            continue
        for part in content:
            if not isinstance(part, dict):
                continue
            kind = part.get("type", "text")
            if (
                not isinstance(kind, str)
                or kind not in _TEXT_PART_TYPES
                or part.keys() & _MEDIA_KEYS
            ):
                return True
    return False
