"""Token-prefix logic: the one place where "may this handle be reused for this prompt" is decided.

Pure and I/O-free. Facts it rests on (``docs/vllm-protocol.md`` §1, §3):

* P trusts that its new prompt N starts with D's sequence S_D up to ``remote_num_tokens`` (R) and
  loads the *last* blocks of D's list for the tokens it lacks (end-trim). Reuse is therefore
  correct only when ``N[:R] == S_D[:R]`` and ``len(N) >= R``; a shorter N that is an exact prefix
  still gets D's tail blocks, so it is not a full reuse.
* A handle cut to whole blocks of the common prefix (``remote_num_tokens`` and every group's
  ``remote_block_ids`` cut to match) is read correctly.
* A handle sent with ``remote_num_tokens: 0`` makes P compute locally and D free the blocks.

S_D is kept as a chain of xxh3-128 digests: digest ``i`` covers tokens ``[0, (i+1)*chunk)``
(a running hash, so each digest stands for everything before it), plus the tokens after the last
whole chunk. The chunk is a whole number of the decode instance's KV blocks.
"""

from __future__ import annotations

import array
import sys
from collections.abc import Sequence
from enum import StrEnum
from typing import Any

import msgspec
import xxhash

__all__ = [
    "DEFAULT_CHUNK_TOKENS",
    "DEFAULT_SETTINGS",
    "ID_BYTES",
    "HashedTokens",
    "Path",
    "Plan",
    "PlanSettings",
    "Reason",
    "TokenPrefix",
    "block_size_of",
    "chunk_size_for",
    "handle_tokens",
    "pack_ids",
    "plan_reuse",
    "release_handle",
    "truncate_handle",
]

#: Target granularity of partial reuse, in tokens (rounded to whole KV blocks).
DEFAULT_CHUNK_TOKENS = 256

_TOKEN = "I"  # token ids are stored as little-endian uint32
ID_BYTES = 4  # bytes of one packed token id
_LITTLE = sys.byteorder == "little"


def pack_ids(ids: Sequence[int]) -> bytes:
    """Token ids as little-endian uint32 (``OverflowError`` for one outside it): hashed for
    the store's prefixes and the KV index's chains alike."""
    packed = array.array(_TOKEN)
    packed.fromlist(list(ids) if not isinstance(ids, list) else ids)
    if not _LITTLE:  # pragma: no cover - every supported platform is little-endian
        packed.byteswap()
    return packed.tobytes()


def _unpack(data: bytes) -> list[int]:
    packed = array.array(_TOKEN)
    packed.frombytes(data)
    if not _LITTLE:  # pragma: no cover
        packed.byteswap()
    return packed.tolist()


def chunk_size_for(block_size: int, target: int = DEFAULT_CHUNK_TOKENS) -> int:
    """The hash-chain chunk for a KV block size: the largest whole number of blocks <= target
    (at least one block)."""
    if block_size <= 0:
        raise ValueError("block size must be positive")
    return block_size * max(1, target // block_size)


class HashedTokens:
    """A prompt's token ids with the running digests at every chunk boundary.

    Built once per turn: the plan compares it with the stored prefix, and the next record's
    prefix is cut from the same digests when the chunk size agrees.
    """

    __slots__ = ("_boundary", "chunk_size", "digests", "packed")

    def __init__(self, ids: Sequence[int], chunk_size: int) -> None:
        self.chunk_size = chunk_size
        self.packed = b""
        self.digests: list[bytes] = []
        self._boundary = xxhash.xxh3_128()  # running state at the last whole chunk
        self._append(pack_ids(ids))

    def _append(self, packed: bytes) -> None:
        step = self.chunk_size * ID_BYTES
        start = len(self.digests) * step
        self.packed += packed
        view = memoryview(self.packed)
        hasher = self._boundary
        for offset in range(start, len(self.packed) - step + 1, step):
            hasher.update(view[offset : offset + step])
            self.digests.append(hasher.digest())

    def extended(self, ids: Sequence[int]) -> HashedTokens:
        """These tokens followed by ``ids``, hashing only what is new."""
        other = HashedTokens.__new__(HashedTokens)
        other.chunk_size = self.chunk_size
        other.packed = self.packed
        other.digests = list(self.digests)
        other._boundary = self._boundary.copy()
        other._append(pack_ids(ids))
        return other

    def tokens(self) -> list[int]:
        return _unpack(self.packed)

    def __len__(self) -> int:
        return len(self.packed) // ID_BYTES

    def digest_of_prefix(self, length: int) -> bytes:
        """Digest of the first ``length`` tokens (the same function the chain uses)."""
        return xxhash.xxh3_128(memoryview(self.packed)[: length * ID_BYTES]).digest()

    def prefix(self, length: int, *, output_start: int) -> TokenPrefix:
        """The stored form of the first ``length`` tokens."""
        return TokenPrefix.build(self, length, output_start=output_start)


class TokenPrefix(msgspec.Struct, frozen=True, array_like=True):
    """S_D as stored: running digests of whole chunks, then the remaining tokens verbatim.

    ``output_start`` is where D's output began in S_D; ``output_digest`` covers
    ``S_D[:output_start]`` so a divergence can be placed before or after it without keeping the
    tokens.
    """

    chunk_size: int
    length: int
    digests: list[bytes]
    tail: bytes
    output_start: int
    output_digest: bytes

    @classmethod
    def build(cls, tokens: HashedTokens, length: int, *, output_start: int) -> TokenPrefix:
        if not 0 <= length <= len(tokens):
            raise ValueError("prefix length out of range")
        whole = length // tokens.chunk_size
        start = whole * tokens.chunk_size * ID_BYTES
        output_start = min(output_start, length)
        return cls(
            chunk_size=tokens.chunk_size,
            length=length,
            digests=tokens.digests[:whole],
            tail=tokens.packed[start : length * ID_BYTES],
            output_start=output_start,
            output_digest=tokens.digest_of_prefix(output_start),
        )

    @property
    def tail_start(self) -> int:
        return len(self.digests) * self.chunk_size

    def tail_tokens(self) -> list[int]:
        return _unpack(self.tail)

    def common_length(self, tokens: HashedTokens) -> int:
        """How many leading tokens of ``tokens`` are known to equal this prefix.

        Exact when the first difference lies in the tail; otherwise rounded down to the start of
        the first chunk whose digest differs.
        """
        if tokens.chunk_size != self.chunk_size:
            raise ValueError("prompt hashed with a different chunk size than the stored prefix")
        matched = 0
        theirs = tokens.digests
        for mine, other in zip(self.digests, theirs, strict=False):
            if mine != other:
                return matched * self.chunk_size
            matched += 1
        if matched < len(self.digests):
            # The prompt ends inside the hashed part: its last partial chunk has no digest to
            # compare, so reuse stops at the last whole matching chunk (conservative).
            return matched * self.chunk_size
        start = self.tail_start * ID_BYTES
        other_tail = tokens.packed[start : start + len(self.tail)]
        if other_tail == self.tail:
            return self.length
        return self.tail_start + _first_difference(self.tail, other_tail)

    def agrees_as_far_as_known(self, tokens: HashedTokens, common: int) -> bool:
        """True when ``tokens`` is shorter than S_D and no difference was found: an exact prefix,
        or one whose last partial chunk (inside the hashed part) cannot be checked."""
        size = len(tokens)
        if size >= self.length:
            return False
        if common == size:
            return True
        return size < self.tail_start and common == size - size % self.chunk_size

    def diverges_in_output(self, tokens: HashedTokens) -> bool:
        """True when ``tokens`` agree with S_D up to where D's output began."""
        if len(tokens) < self.output_start:
            return False
        return tokens.digest_of_prefix(self.output_start) == self.output_digest


def _first_difference(a: bytes, b: bytes) -> int:
    """Index (in tokens) of the first token where two packed sequences differ."""
    n = min(len(a), len(b))
    lo, hi = 0, n // ID_BYTES
    # Binary search on equal prefixes: bytes comparison of slices is done in C.
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[: mid * ID_BYTES] == b[: mid * ID_BYTES]:
            lo = mid
        else:
            hi = mid - 1
    return lo


class Path(StrEnum):
    """What the router does with a conversation's stored handle this turn."""

    REUSE = "reuse"  #: send the handle as stored; P pulls all of S_D[:R]
    PARTIAL = "partial"  #: send a handle cut to whole blocks of the common prefix
    RELEASE = "release"  #: send the handle with remote_num_tokens 0: P computes, D frees
    COLD = "cold"  #: no handle to send


class Reason(StrEnum):
    """Why a turn did not reuse everything (closed vocabulary: metric labels, logs, reports)."""

    NO_RECORD = "no_record"
    EXPIRED = "expired"
    STALE_ENGINE = "stale_engine"
    DIVERGED_IN_HISTORY = "diverged_in_history"
    DIVERGED_IN_LAST_OUTPUT = "diverged_in_last_output"
    PROMPT_SHORTER = "prompt_shorter"
    BELOW_THRESHOLD = "below_threshold"
    BAD_HANDLE = "bad_handle"
    #: several KV cache groups of different lengths (hybrid or sliding-window models): a
    #: sliding-window group keeps only its window, so cutting every group to the same number
    #: of blocks would hand P the wrong blocks. Such a handle is used whole or released.
    UNCUTTABLE_HANDLE = "uncuttable_handle"
    #: P's own prefix cache already holds all but a few of the handle's tokens: a pull would
    #: cost more than computing them (the router's turn costs), so the handle is given back.
    PULL_DOES_NOT_PAY = "pull_does_not_pay"


class PlanSettings(msgspec.Struct, frozen=True):
    """Knobs of :func:`plan_reuse`.

    ``recompute_threshold`` mirrors vLLM's ``kv_recompute_threshold`` (default 64 tokens): a
    reuse smaller than that is not worth a transfer, so the handle is released instead.
    """

    partial_reuse: bool = True
    recompute_threshold: int = 64


DEFAULT_SETTINGS = PlanSettings()


class Plan(msgspec.Struct, frozen=True):
    """The decision for one turn.

    ``handle`` is what goes to P (``None`` for a cold turn); ``reused_tokens`` how many prompt
    tokens P will pull; ``common`` the known common prefix length (``None`` when not compared).
    """

    path: Path
    reason: Reason | None = None
    handle: dict[str, Any] | None = None
    reused_tokens: int = 0
    common: int | None = None

    @property
    def attaches_handle(self) -> bool:
        return self.handle is not None


def handle_tokens(handle: dict[str, Any]) -> int:
    """``remote_num_tokens`` of a handle (missing counts as 0, as vLLM reads it)."""
    value = handle.get("remote_num_tokens") or 0
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError("remote_num_tokens must be a non-negative integer")
    return value


def _block_groups(handle: dict[str, Any]) -> list[list[int]]:
    groups = handle.get("remote_block_ids")
    if not isinstance(groups, list) or not groups or not all(isinstance(g, list) for g in groups):
        raise ValueError("remote_block_ids must be a non-empty list of lists")
    return groups


def block_size_of(handle: dict[str, Any], configured: int | None = None) -> int:
    """The decode instance's KV block size for this handle.

    A handle of R tokens lists ``cdiv(R, block_size)`` blocks in each full-attention group. The
    configured size is used when it agrees with that; otherwise the smallest power of two that
    does (vLLM block sizes are powers of two: 16 on GPU builds, 128 on the CPU build).
    """
    tokens = handle_tokens(handle)
    blocks = len(_block_groups(handle)[0])
    if blocks == 0 or tokens == 0:
        raise ValueError("a handle with no tokens has no block size")

    def fits(size: int) -> bool:
        return -(-tokens // size) == blocks

    if configured is not None and fits(configured):
        return configured
    size = 1
    while size <= 1 << 16:
        if fits(size):
            return size
        size <<= 1
    raise ValueError(f"no block size fits {tokens} tokens in {blocks} blocks")


def truncate_handle(handle: dict[str, Any], tokens: int, block_size: int) -> dict[str, Any]:
    """A copy of ``handle`` that covers only its first ``tokens`` tokens (whole blocks kept)."""
    keep = -(-tokens // block_size)
    cut = dict(handle)
    cut["remote_num_tokens"] = tokens
    cut["remote_block_ids"] = [list(group[:keep]) for group in _block_groups(handle)]
    return cut


def release_handle(handle: dict[str, Any]) -> dict[str, Any]:
    """A copy of ``handle`` that makes P compute locally and D free the blocks at once."""
    released = dict(handle)
    released["remote_num_tokens"] = 0
    return released


def plan_reuse(
    prefix: TokenPrefix,
    handle: dict[str, Any],
    block_size: int,
    prompt: HashedTokens,
    settings: PlanSettings = DEFAULT_SETTINGS,
) -> Plan:
    """Decide how much of a live handle the prompt may reuse.

    Expiry and engine staleness are the caller's (``carryover.state.records``); this function only compares
    tokens. ``prompt`` must be hashed with ``prefix.chunk_size``.
    """
    try:
        total = handle_tokens(handle)
        _block_groups(handle)
    except ValueError:
        return Plan(Path.COLD, Reason.BAD_HANDLE)
    if total != prefix.length:
        # The stored tokens do not describe this handle: never guess.
        return Plan(Path.RELEASE, Reason.BAD_HANDLE, release_handle(handle))
    common = min(prefix.common_length(prompt), total)
    if common == total and len(prompt) >= total:
        if total == 0 or total < settings.recompute_threshold:
            return Plan(Path.RELEASE, Reason.BELOW_THRESHOLD, release_handle(handle), 0, common)
        return Plan(Path.REUSE, None, handle, total, common)

    if prefix.agrees_as_far_as_known(prompt, common):
        reason = Reason.PROMPT_SHORTER
    elif prefix.diverges_in_output(prompt):
        reason = Reason.DIVERGED_IN_LAST_OUTPUT
    else:
        reason = Reason.DIVERGED_IN_HISTORY
    # Whole blocks only, and leave P at least one token to compute itself.
    usable = min(common, len(prompt) - 1)
    usable -= usable % block_size
    if not settings.partial_reuse:
        return Plan(Path.RELEASE, reason, release_handle(handle), 0, common)
    if len({len(group) for group in _block_groups(handle)}) > 1:
        return Plan(Path.RELEASE, Reason.UNCUTTABLE_HANDLE, release_handle(handle), 0, common)
    if usable <= 0 or usable < settings.recompute_threshold:
        return Plan(Path.RELEASE, reason, release_handle(handle), 0, common)
    return Plan(Path.PARTIAL, reason, truncate_handle(handle, usable, block_size), usable, common)
