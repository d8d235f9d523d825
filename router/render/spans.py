"""Tokenizing a rendered prompt span by span, so that a conversation's next turn only
tokenizes what is new.

A Hugging Face tokenizer splits its input at added tokens (``<|im_start|>``, ``<think>``, ...)
before anything else, and encodes the text between them independently: no token ever spans an
added token. So the ids of a prompt are the ids of its spans, joined by the added tokens' ids,
and a span seen before (an earlier message, a shared system prompt or tool list) need not be
tokenized again. That holds only when no added token strips the whitespace around it or is
matched on normalized text, and when a span encodes alike wherever it stands: a Metaspace
pre-tokenizer with ``prepend_scheme: first`` (Llama 2, Mistral and Gemma files converted by
``transformers``) marks only the text at the very start of the input with ``▁``. A tokenizer
that fails either is encoded whole; the second is checked on sample spans at load.
"""

from __future__ import annotations

import re
import threading
from collections import OrderedDict

from tokenizers import Tokenizer

from carryover.router.render.fast_bpe import FastBpe

__all__ = ["SpanEncoder"]

#: Spans tried on both sides of an added token: a word, one after a space, a newline.
_SAMPLE_SPANS = ("word", " word", "\nword 12")


def _spans_encode_alike(tokenizer: Tokenizer, added: list[str]) -> bool:
    """Whether each sample span encodes, between added tokens, as it does alone."""
    alone = {span: tokenizer.encode(span, add_special_tokens=False).ids for span in _SAMPLE_SPANS}
    for token in added[:3]:
        token_ids = tokenizer.encode(token, add_special_tokens=False).ids
        for before in _SAMPLE_SPANS:
            for after in _SAMPLE_SPANS:
                whole = tokenizer.encode(before + token + after, add_special_tokens=False).ids
                if whole != alone[before] + token_ids + alone[after]:
                    return False
    return True


class SpanEncoder:
    """``encode(text)`` equal to ``tokenizer.encode(text, add_special_tokens=False).ids``,
    with the ids of every span between added tokens kept in an LRU bounded in characters.

    ``fast``, when given, encodes new spans in the tokenizer's stead (it must give the same
    ids: :mod:`carryover.router.render.fast_bpe` checks that before it hands one out)."""

    def __init__(
        self, tokenizer: Tokenizer, max_chars: int = 16_000_000, fast: FastBpe | None = None
    ) -> None:
        self._tokenizer = tokenizer
        self._fast = fast
        self.max_chars = max_chars
        added = tokenizer.get_added_tokens_decoder()
        self.enabled = bool(added) and not any(
            token.lstrip or token.rstrip or token.normalized or token.single_word
            for token in added.values()
        )
        self._ids = {token.content: token_id for token_id, token in added.items()}
        if self.enabled:
            self.enabled = _spans_encode_alike(tokenizer, sorted(self._ids))
        # Longest first: the tokenizer matches the leftmost longest added token.
        alternatives = sorted(self._ids, key=len, reverse=True)
        self._split = re.compile("(" + "|".join(map(re.escape, alternatives)) + ")")
        self._spans: OrderedDict[str, list[int]] = OrderedDict()
        self._chars = 0
        self._lock = threading.Lock()  # renders run in worker threads
        self.hits = 0
        self.misses = 0

    def has_added_token(self, text: str) -> bool:
        return self._split.search(text) is not None

    def _encode_whole(self, text: str) -> list[int]:
        ids: list[int] = self._tokenizer.encode(text, add_special_tokens=False).ids
        return ids

    def encode(self, text: str) -> list[int]:
        if not self.enabled:
            return self._encode_whole(text)
        parts = self._split.split(text)
        spans = [part for part in dict.fromkeys(parts[::2]) if part]  # text between added tokens
        known = self._known(spans)
        missing = [span for span in spans if span not in known]
        if missing:
            known.update(self._encode_new(missing))
        ids: list[int] = []
        special = self._ids
        for i, part in enumerate(parts):
            if i % 2:  # the separators the split kept: added tokens
                ids.append(special[part])
            elif part:
                ids.extend(known[part])
        return ids

    def _known(self, spans: list[str]) -> dict[str, list[int]]:
        found: dict[str, list[int]] = {}
        with self._lock:
            for span in spans:
                ids = self._spans.get(span)
                if ids is not None:
                    self._spans.move_to_end(span)
                    found[span] = ids
            self.hits += len(found)
        return found

    def _encode_new(self, spans: list[str]) -> dict[str, list[int]]:
        if self._fast is not None:
            encoded = [self._fast.encode(span) for span in spans]
        else:
            # A turn usually brings two new spans (the last answer and the new message): one
            # batch call lets the tokenizer encode them side by side.
            batch = self._tokenizer.encode_batch_fast(spans, add_special_tokens=False)
            encoded = [list(e.ids) for e in batch]
        with self._lock:
            self.misses += len(spans)
            for span, ids in zip(spans, encoded, strict=True):
                if span not in self._spans and len(span) <= self.max_chars:
                    self._spans[span] = ids
                    self._chars += len(span)
            while self._chars > self.max_chars:
                old, _ = self._spans.popitem(last=False)
                self._chars -= len(old)
        return dict(zip(spans, encoded, strict=True))
