"""A prompt longer than the model's context, refused as vLLM refuses it, before its ids exist.

vLLM refuses a prompt of more than ``max_model_len`` tokens with a 400 (``_token_len_check``
in ``vllm/renderers/params.py``, 0.32), and a text prompt of more characters than that many
tokens can hold before tokenizing it (``_text_len_check``: ``max_model_len`` times the
longest token in the vocabulary, ``max_chars_per_token`` in ``vllm/tokenizers/hf.py``). The
router checks the same two bounds where it renders, so that a 10 MB tool list costs neither
a million Python ints (a single call holding the GIL for tens of milliseconds) nor P's time.
"""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer

from carryover.router.errors import BadRequest
from carryover.router.render.errors import RenderInputError

__all__ = [
    "PromptTooLong",
    "check_chars",
    "check_tokens",
    "max_chars_per_token",
    "refuse_past_context",
]


class PromptTooLong(RenderInputError):
    """A 400 naming the model's context and the part of the prompt past it (``param``)."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def max_chars_per_token(folder: Path, tokenizer: Tokenizer) -> int:
    """vLLM's bound: the longest token text in the vocabulary, added tokens included; read
    once per folder and process (listing a 150k vocabulary holds the GIL for ~0.1 s)."""
    key = folder.resolve()
    if key not in _LONGEST:
        _LONGEST[key] = max(len(text) for text in tokenizer.get_vocab(with_added_tokens=True))
    return _LONGEST[key]


_LONGEST: dict[Path, int] = {}


def check_chars(chars: int, max_model_len: int | None, per_token: int) -> None:
    """Refuse ``chars`` characters of prompt text that ``max_model_len`` tokens cannot hold."""
    if max_model_len is None or chars <= max_model_len * per_token:
        return
    raise PromptTooLong(
        f"This model's maximum context length is {max_model_len} tokens. However, your prompt "
        f"contains {chars} characters (more than {max_model_len * per_token} characters, "
        f"which is the upper bound for {max_model_len} input tokens). "
        "Please reduce the length of the input prompt.",
        param="input_text",
    )


def check_tokens(tokens: int, max_model_len: int | None, *, at_least: bool = False) -> None:
    """Refuse a prompt of ``tokens`` tokens (``at_least``: a part of it has that many)."""
    if max_model_len is None or tokens <= max_model_len:
        return
    qualifier = "at least " if at_least else ""
    raise PromptTooLong(
        f"This model's maximum context length is {max_model_len} tokens. However, your prompt "
        f"contains {qualifier}{tokens} input tokens, which exceeds this limit even without "
        "any output tokens. Please reduce the length of the input prompt.",
        param="input_tokens",
    )


def refuse_past_context(tokens: int, max_model_len: int | None) -> None:
    """:func:`check_tokens` as the 400 a turn answers with (ids any renderer gave)."""
    try:
        check_tokens(tokens, max_model_len)
    except PromptTooLong as exc:
        raise BadRequest(str(exc), param=exc.param) from exc
