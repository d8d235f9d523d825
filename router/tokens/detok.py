"""The render server's plain streaming derender, in this process: for a streamed answer no
parser needs to see (no reasoning parser, no tools, no logprobs), each chunk of D's tokens is
detokenized here, incrementally, O(n) over the answer, with no call per chunk.

The algorithm is vLLM's ``detokenize_incrementally`` (``vllm/tokenizers/detokenizer_utils.py``)
on token ids: a window of ids from ``prefix`` on; text is released once decoding the window
adds characters that do not end in U+FFFD (a partial UTF-8 sequence), and the window is seeded
with the prompt's last ids, as vLLM seeds it (``convert_prompt_ids_to_tokens``), so the first
token's leading space decodes as it does there. It is used only when this process's tokenizer
gave the render server's ids on the startup probes (router/tokens/check.py).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from tokenizers import Tokenizer

__all__ = ["LocalDetokenizer", "Vocabulary"]

# vLLM's INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET, and the two more prompt ids it converts.
_OFFSET = 5
_SEED = _OFFSET + 2


@dataclass(frozen=True)
class Vocabulary:
    """A tokenizer and its special ids, read once per model (not once per stream)."""

    tokenizer: Tokenizer
    special: frozenset[int]

    @classmethod
    def of(cls, tokenizer: Tokenizer) -> Vocabulary:
        decoder = tokenizer.get_added_tokens_decoder()
        return cls(tokenizer, frozenset(i for i, token in decoder.items() if token.special))


class LocalDetokenizer:
    """Stands in for ``RenderServerClient.derender_chunk`` (same arguments and results)."""

    def __init__(self, vocabulary: Vocabulary, *, model: str, skip_special_tokens: bool) -> None:
        self._tokenizer = vocabulary.tokenizer
        self._special = vocabulary.special
        self._model = model
        self._skip = skip_special_tokens
        self._created = int(time.time())

    def _seed(self, prompt_ids: list[int]) -> dict[str, Any]:
        window = prompt_ids[-_SEED:]
        if self._skip:
            window = [i for i in window if i not in self._special]
        read = len(window)
        return {"ids": window, "prefix": max(read - _OFFSET, 0), "read": read, "role_sent": False}

    def _step(self, state: dict[str, Any], token_id: int) -> str:
        ids: list[int] = state["ids"]
        if self._skip and token_id in self._special:
            return ""
        ids.append(token_id)
        prefix, read = state["prefix"], state["read"]
        decode = self._tokenizer.decode
        prefix_text = decode(ids[prefix:read], skip_special_tokens=self._skip)
        new_text = decode(ids[prefix:], skip_special_tokens=self._skip)
        if len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd"):
            return ""
        # The new prefix starts at the old read offset; nothing before it is read again.
        del ids[:read]
        state["prefix"], state["read"] = 0, len(ids)
        return new_text[len(prefix_text) :]

    async def derender_chunk(
        self,
        chunk: dict[str, Any],
        state: dict[str, Any] | None,
        prompt_ids: list[int],
        request: dict[str, Any],
        *,
        chat: bool,
    ) -> tuple[dict[str, Any], dict[str, Any]]:
        current = state if state is not None else self._seed(prompt_ids)
        choices = []
        for part in chunk.get("choices") or ():
            text = "".join(self._step(current, i) for i in part.get("token_ids") or ())
            if chat:
                role = None if current["role_sent"] else "assistant"
                current["role_sent"] = True
                choices.append(
                    {
                        "index": part.get("index", 0),
                        "delta": {"role": role, "content": text or None},
                        "logprobs": None,
                        "finish_reason": part.get("finish_reason"),
                        "stop_reason": part.get("stop_reason"),
                        "token_ids": None,
                    }
                )
            else:
                choices.append(
                    {
                        "index": part.get("index", 0),
                        "text": text,
                        "logprobs": None,
                        "finish_reason": part.get("finish_reason"),
                        "stop_reason": part.get("stop_reason"),
                    }
                )
        usage = chunk.get("usage")
        if isinstance(usage, dict):
            completion = int(usage.get("completion_tokens") or 0)
            usage = {
                "prompt_tokens": len(prompt_ids),
                "completion_tokens": completion,
                "total_tokens": len(prompt_ids) + completion,
            }
        out = {
            "id": chunk.get("request_id"),
            "object": "chat.completion.chunk" if chat else "text_completion",
            "created": self._created,
            "model": self._model,
            "choices": choices,
            "usage": usage,
        }
        return out, current
