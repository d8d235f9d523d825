"""A faster encoder for the text between added tokens, for byte-level BPE tokenizers of
tiktoken's shape.

Hugging Face's ``tokenizers`` spends about 2 µs a token on a Qwen3 span here, most of it in
offsets, alignments and per-call objects that a router never reads; tiktoken's core encodes the
same text several times faster. The two agree only when the tokenizer is one tiktoken can
express, as vocabularies converted from tiktoken files are (Qwen3's is);
:func:`fast_bpe_for` checks that shape in ``tokenizer.json`` and refuses anything else:

- the model is BPE without dropout, unknown token, byte fallback, or subword affixes;
- the normalizer is NFC or none (applied here with ``unicodedata``);
- the pre-tokenizer is one regex ``Split`` (``Isolated``) followed by ``ByteLevel`` without a
  prefix space or a regex of its own: tiktoken's ``pat_str`` and its byte handling;
- ids 0..255 are the 256 single bytes and merge ``i`` produces id ``256 + i``, so that a
  token's id is its merge rank, which is the rank tiktoken merges by.

Added tokens are not its business: :class:`~router.render.spans.SpanEncoder` splits them off
first. Once built, the encoder is checked against the tokenizer on sample texts, and is not
used if they differ in any id.
"""

from __future__ import annotations

import logging
import unicodedata
from collections.abc import Callable
from functools import cache
from pathlib import Path
from typing import Any

import msgspec
import tiktoken
from tokenizers import Tokenizer

from carryover.router.render.context import check_tokens

__all__ = ["FastBpe", "fast_bpe_for", "refusal"]

log = logging.getLogger(__name__)

#: A special token no text is allowed to be (see :class:`FastBpe`).
_NEVER = "<|carryover: never a token|>"
#: Texts longer than this are counted before their ids are listed (shorter ones cost less
#: than the count).
_COUNTED_CHARS = 65_536

#: Texts an encoder must tokenize as the tokenizer does before it is used: contractions,
#: digits, whitespace runs and newlines, punctuation, and non-Latin scripts, composed and not.
SAMPLES = (
    "Hello, world! It's a test: we'll see what they've done, I'd say.",
    "  leading spaces\n\n\ttabs and\r\nCRLF   trailing   ",
    "Numbers 1234567890 and 3.14159, -42, 1e-9; code: def f(x): return x**2 # ok",
    "Unicode: café naïve Ωmega 日本語のテキスト 한국어 العربية emoji 🙂👍🏽 — “quotes”",
    "e\u0301 composed differently, Å vs A\u030a, and ﬁ ligature",
    "{'json': [1, 2, {\"k\": null}]}\n```python\nprint('x')\n```\n",
)


class FastBpe:
    """``encode(text)`` equal to the tokenizer's ids for text without added tokens."""

    def __init__(self, name: str, pattern: str, ranks: dict[bytes, int], nfc: bool) -> None:
        # One special token, never allowed: tiktoken's core then encodes every text as
        # ordinary text, and without one its search for specials matches at every position.
        encoding = tiktoken.Encoding(
            name, pat_str=pattern, mergeable_ranks=ranks, special_tokens={_NEVER: len(ranks)}
        )
        self._encode: Callable[[str], list[int]] = encoding.encode_ordinary
        self._encode_buffer: Callable[[str, set[str]], Any] = (
            encoding._core_bpe.encode_to_tiktoken_buffer
        )
        # The Python dict of ~150k byte strings is only needed to build the native core:
        # emptied, it gives back ~25 MiB of a router's resident memory.
        ranks.clear()
        self._nfc = nfc

    def encode(self, text: str, max_model_len: int | None = None) -> list[int]:
        """The ids of ``text``; with ``max_model_len``, more ids than that raise
        :class:`~router.render.context.PromptTooLong` before any becomes a Python int."""
        if self._nfc and not text.isascii():  # ASCII is NFC already
            text = unicodedata.normalize("NFC", text)
        if max_model_len is None or len(text) <= _COUNTED_CHARS:
            return self._encode(text)
        # tiktoken encodes without the GIL and then makes each id a Python int holding it
        # (3.4 ms a MB of text); a buffer of them is counted first. Its core reports the
        # buffer's length in bytes, so it is read as bytes and cast to 32-bit ids.
        ids = memoryview(self._encode_buffer(text, set())).cast("B").cast("I")
        check_tokens(len(ids), max_model_len, at_least=True)
        listed: list[int] = ids.tolist()
        return listed

    def agrees(self, tokenizer: Tokenizer, texts: tuple[str, ...] = SAMPLES) -> bool:
        """Whether every text encodes to the tokenizer's own ids."""
        expected = tokenizer.encode_batch_fast(list(texts), add_special_tokens=False)
        return all(self.encode(t) == e.ids for t, e in zip(texts, expected, strict=True))


def refusal(spec: dict[str, Any]) -> str | None:
    """Why a ``tokenizer.json`` is not of the shape :class:`FastBpe` reproduces (``None``:
    it is)."""
    model = spec.get("model") or {}
    if model.get("type") != "BPE":
        return "the model is not BPE"
    if model.get("dropout") or model.get("unk_token") or model.get("byte_fallback"):
        return "the BPE model uses dropout, an unknown token or byte fallback"
    if model.get("continuing_subword_prefix") or model.get("end_of_word_suffix"):
        return "the BPE model uses subword affixes"
    normalizer = spec.get("normalizer")
    if normalizer is not None and normalizer.get("type") != "NFC":
        return "the normalizer is neither NFC nor absent"
    if _pattern(spec.get("pre_tokenizer") or {}) is None:
        return "the pre-tokenizer is not one regex split followed by byte-level"
    vocab: dict[str, int] = model.get("vocab") or {}
    merges: list[Any] = model.get("merges") or []
    if len(vocab) != 256 + len(merges):
        return "the vocabulary is not the 256 bytes plus one token per merge"
    byte_of = _byte_decoder()
    singles = [text for text, token_id in vocab.items() if token_id < 256]
    if len(singles) != 256 or any(len(text) != 1 or text not in byte_of for text in singles):
        return "ids below 256 are not the 256 single bytes"
    for i, merge in enumerate(merges):
        left, right = merge.split(" ", 1) if isinstance(merge, str) else merge
        if vocab.get(left + right) != 256 + i:
            return "a merge does not produce the id after the previous merge's"
    return None


def _pattern(pre_tokenizer: dict[str, Any]) -> str | None:
    steps = pre_tokenizer.get("pretokenizers") if pre_tokenizer.get("type") == "Sequence" else []
    if not steps or len(steps) != 2:
        return None
    split, byte_level = steps
    regex = (split.get("pattern") or {}).get("Regex")
    if (
        split.get("type") != "Split"
        or split.get("behavior") != "Isolated"
        or split.get("invert")
        or not isinstance(regex, str)
    ):
        return None
    if (
        byte_level.get("type") != "ByteLevel"
        or byte_level.get("add_prefix_space")
        or byte_level.get("use_regex")
    ):
        return None
    return regex


@cache
def _byte_decoder() -> dict[str, int]:
    """GPT-2's map from the printable characters a byte-level vocabulary is written in back
    to the bytes they stand for."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    printable += range(ord("®"), ord("ÿ") + 1)
    chars = list(printable)
    extra = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars, strict=True)}


def _build(folder: Path, tokenizer: Tokenizer) -> FastBpe | None:
    path = folder / "tokenizer.json"
    spec = msgspec.json.decode(path.read_bytes())
    reason = refusal(spec)
    if reason is not None:
        log.info("spans of %s are encoded by the tokenizer: %s", path, reason)
        return None
    # Each character of the byte-level alphabet stands for one byte: translated to the
    # character of that code point, Latin-1 gives the bytes back (twice as fast as by byte).
    to_latin1 = str.maketrans({char: chr(byte) for char, byte in _byte_decoder().items()})
    ranks = {
        text.translate(to_latin1).encode("latin-1"): token_id
        for text, token_id in spec["model"]["vocab"].items()
    }
    pattern = _pattern(spec["pre_tokenizer"])
    assert pattern is not None  # refusal() checked it
    nfc = (spec.get("normalizer") or {}).get("type") == "NFC"
    encoder = FastBpe(str(path), pattern, ranks, nfc)
    if not encoder.agrees(tokenizer):
        log.warning("spans of %s are encoded by the tokenizer: the fast encoder differs", path)
        return None
    return encoder


_BUILT: dict[Path, FastBpe | None] = {}


def fast_bpe_for(folder: Path, tokenizer: Tokenizer) -> FastBpe | None:
    """The fast encoder of ``tokenizer`` (loaded from ``folder``), or ``None`` where it would
    not give the tokenizer's ids; built once per folder and process."""
    key = folder.resolve()
    if key not in _BUILT:
        _BUILT[key] = _build(key, tokenizer)
    return _BUILT[key]
