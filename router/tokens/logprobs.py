"""Logprobs of a streamed answer the render server's parsed path leaves out.

vLLM 0.32's streaming derender with a reasoning or tool parser returns ``logprobs: null``
(``renderers/online_derenderer.py``, "That parsed path does not resolve logprobs yet"); the
engine's chunks carry them as integer token ids. They are resolved here the way vLLM's plain
path and whole answers do (``_resolve_logprobs``): each id decoded on its own, and a token
that decodes to half a UTF-8 character (U+FFFD) decoded again with up to four preceding
sampled ids as context. Only with a tokenizer that gave the render server's ids at startup.
"""

from __future__ import annotations

from typing import Any

from tokenizers import Tokenizer

__all__ = ["resolve_logprobs"]

_CONTEXT = 4  # vLLM keeps this many preceding sampled ids (logprob_context_token_ids)
_BAD = "\ufffd"


def _decoded(tokenizer: Tokenizer, token_id: int) -> tuple[str, list[int] | None]:
    if tokenizer.id_to_token(token_id) is None:
        return "", None  # no vocabulary entry
    text: str = tokenizer.decode([token_id], skip_special_tokens=False)
    return text, list(text.encode("utf-8", errors="replace"))


def _corrected(tokenizer: Tokenizer, token_id: int, context: list[int]) -> str:
    """vLLM's ``_correct_decoded_token``."""
    decode = tokenizer.decode
    for size in range(1, min(len(context), _CONTEXT) + 1):
        window = context[-size:]
        full: str = decode([*window, token_id], skip_special_tokens=False)
        if full.endswith(_BAD):
            continue
        clean_end = len(window)
        for j in range(len(window) - 1, -1, -1):
            if decode([window[j]], skip_special_tokens=False).endswith(_BAD):
                clean_end = j
            else:
                break
        prefix: str = decode(window[:clean_end], skip_special_tokens=False) if clean_end else ""
        if full.startswith(prefix):
            return full[len(prefix) :]
        common = 0
        for a, b in zip(prefix, full, strict=False):
            if a != b:
                break
            common += 1
        return full[common:]
    return ""


def _entry(tokenizer: Tokenizer, token_id: int, logprob: Any, context: list[int]) -> dict[str, Any]:
    text, raw = _decoded(tokenizer, token_id)
    if text.endswith(_BAD):
        text = _corrected(tokenizer, token_id, context)
        raw = list(text.encode("utf-8"))
    return {"token": text, "logprob": logprob, "bytes": raw}


def resolve_logprobs(
    content: list[dict[str, Any]], tokenizer: Tokenizer, context: list[int]
) -> dict[str, Any]:
    """OpenAI chat logprobs from generate's ``[{token_id, logprob, top_logprobs}]``;
    ``context`` (the sampled ids before these, kept by the caller) is extended."""
    resolved = []
    for item in content:
        token_id = int(item["token_id"])
        entry = _entry(tokenizer, token_id, item.get("logprob"), context)
        entry["top_logprobs"] = [
            _entry(tokenizer, int(top["token_id"]), top.get("logprob"), context)
            for top in item.get("top_logprobs") or ()
        ]
        resolved.append(entry)
        context.append(token_id)
        del context[:-_CONTEXT]
    return {"content": resolved}
