"""Tokenizing a rendered prompt span by span, so that a conversation's next turn only
tokenizes what is new.

A Hugging Face tokenizer splits its input at added tokens (``<|im_start|>``, ``<think>``, ...)
before anything else, and encodes the text between them independently: no token ever spans an
added token. So the ids of a prompt are the ids of its spans, joined by the added tokens' ids,
and a span seen before (an earlier message, a shared system prompt or tool list) need not be
tokenized again. That holds only when no added token strips the whitespace around it or is
matched on normalized text (else prompts are encoded whole), and when a span encodes alike
wherever it stands. A Metaspace pre-tokenizer with ``prepend_scheme: first`` (Llama 2, Mistral
and Gemma files converted by ``transformers``) marks only the text at the input's very start
with ``▁``: there a new span is encoded behind an added token, whose ids are taken off, and
the text before a prompt's first added token alone. Which of the two holds is checked on
sample spans at load; with neither, prompts are encoded whole.
"""

from __future__ import annotations

import re
import threading
from array import array
from collections import OrderedDict
from collections.abc import Sequence

from tokenizers import Tokenizer

from carryover.router.render.context import check_tokens
from carryover.router.render.fast_bpe import FastBpe

__all__ = ["SPAN_CHARS", "SpanEncoder"]

#: The span cache's default bound, in characters (``render.span_cache_chars``).
SPAN_CHARS = 16_000_000

#: Spans tried on both sides of an added token: a word, one after a space, a newline.
_SAMPLE_SPANS = ("word", " word", "\nword 12")


def _span_anchor(tokenizer: Tokenizer, added: list[str]) -> str | None:
    """How a span is encoded as it stands in a prompt, after an added token: ``""``, alone
    (it encodes alike wherever it stands); an added token, behind it, whose ids are then
    taken off (a tokenizer that marks only the input's start, as Metaspace's
    ``prepend_scheme: first`` does); ``None``: neither holds on the samples."""

    def plain(text: str) -> list[int]:
        ids: list[int] = tokenizer.encode(text, add_special_tokens=False).ids
        return ids

    for anchor in ("", *added[:1]):
        skip = len(plain(anchor))
        in_place = {span: plain(anchor + span)[skip:] for span in _SAMPLE_SPANS}
        if all(
            plain(before + token + after) == plain(before) + plain(token) + in_place[after]
            for token in added[:3]
            for before in _SAMPLE_SPANS
            for after in _SAMPLE_SPANS
        ):
            return anchor
    return None


class SpanEncoder:
    """``encode(text)`` equal to ``tokenizer.encode(text, add_special_tokens=False).ids``,
    with the ids of every span between added tokens kept in an LRU bounded in characters.

    ``fast``, when given, encodes new spans in the tokenizer's stead (it must give the same
    ids: :mod:`carryover.router.render.fast_bpe` checks that before it hands one out)."""

    def __init__(
        self, tokenizer: Tokenizer, max_chars: int = SPAN_CHARS, fast: FastBpe | None = None
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
        # An added token before each new span when spans do not encode alike alone; the text
        # before a prompt's first added token is then encoded alone, uncached.
        self._anchor = _span_anchor(tokenizer, sorted(self._ids)) if self.enabled else None
        self.enabled = self._anchor is not None
        self._anchor_length = len(self._encode_whole(self._anchor)) if self._anchor else 0
        if self._anchor:
            self._fast = None  # its shape holds for tokenizers whose spans encode alike only
        # Longest first: the tokenizer matches the leftmost longest added token.
        alternatives = sorted(self._ids, key=len, reverse=True)
        self._split = re.compile("(" + "|".join(map(re.escape, alternatives)) + ")")
        # 32-bit ids as bytes: 4 bytes an id where a tuple of ints takes 40 (a slot and an
        # int object), so a full cache holds ~2 bytes a character, not ~11; and bytes, unlike
        # arrays, are out of the garbage collector's sight. Listing a cached span costs ~10 ns
        # an id (a tuple's extend: ~1.4 ns), which a 10k-token history pays once a turn.
        self._spans: OrderedDict[str, bytes] = OrderedDict()
        self._chars = 0
        self._lock = threading.Lock()  # renders run in worker threads
        self.hits = 0
        self.misses = 0

    def has_added_token(self, text: str) -> bool:
        return self._split.search(text) is not None

    def _encode_whole(self, text: str, max_model_len: int | None = None) -> list[int]:
        encoding = self._tokenizer.encode(text, add_special_tokens=False)
        check_tokens(len(encoding), max_model_len)  # counted before the ids are listed
        ids: list[int] = encoding.ids
        return ids

    def encode(self, text: str, max_model_len: int | None = None) -> list[int]:
        """The ids of ``text``; with ``max_model_len``, a text of more tokens raises
        :class:`~router.render.context.PromptTooLong`, and none of its spans is kept."""
        if not self.enabled:
            return self._encode_whole(text, max_model_len)
        parts = self._split.split(text)
        head = parts[0] if self._anchor else ""  # at the input's start: encoded alone
        between = parts[2::2] if self._anchor else parts[::2]
        spans = [part for part in dict.fromkeys(between) if part]  # text between added tokens
        known = self._known(spans)
        missing = [span for span in spans if span not in known]
        if missing:
            known.update(self._encode_new(missing, max_model_len))
        ids: list[int] = self._encode_whole(head, max_model_len) if head else []
        special = self._ids
        for i, part in enumerate(parts):
            if i % 2:  # the separators the split kept: added tokens
                ids.append(special[part])
            elif part and (i or not head):
                ids.extend(known[part])
        check_tokens(len(ids), max_model_len)
        return ids

    def _known(self, spans: list[str]) -> dict[str, Sequence[int]]:
        found: dict[str, Sequence[int]] = {}
        with self._lock:
            for span in spans:
                ids = self._spans.get(span)
                if ids is not None:
                    self._spans.move_to_end(span)
                    found[span] = memoryview(ids).cast("I")
            self.hits += len(found)
        return found

    def _encode_new(self, spans: list[str], max_model_len: int | None) -> dict[str, Sequence[int]]:
        if self._fast is not None:
            encoded = [self._fast.encode(span, max_model_len) for span in spans]
        else:
            # A turn usually brings two new spans (the last answer and the new message): one
            # batch call lets the tokenizer encode them side by side.
            anchor, skip = self._anchor or "", self._anchor_length
            batch = self._tokenizer.encode_batch_fast(
                [anchor + span for span in spans], add_special_tokens=False
            )
            for e in batch:
                check_tokens(len(e) - skip, max_model_len, at_least=True)
            encoded = [list(e.ids)[skip:] for e in batch]
        with self._lock:
            self.misses += len(spans)
            for span, ids in zip(spans, encoded, strict=True):
                if span not in self._spans and len(span) <= self.max_chars:
                    self._spans[span] = array("I", ids).tobytes()
                    self._chars += len(span)
            while self._chars > self.max_chars:
                old, _ = self._spans.popitem(last=False)
                self._chars -= len(old)
        return dict(zip(spans, encoded, strict=True))
