"""The stored record of a conversation: which handle D holds and which tokens it covers."""

from __future__ import annotations

from typing import Any

import msgspec

from carryover.state.prefix import TokenPrefix

__all__ = ["Record", "RecordDecodeError"]


class RecordDecodeError(ValueError):
    """Stored bytes that are not a record of this version."""


class Record(msgspec.Struct, frozen=True, kw_only=True):
    """One conversation's reusable state after a finished turn.

    Attributes:
        turn: ordering key of the turn that wrote it (a later turn overwrites an earlier one,
            never the reverse).
        handle: D's ``kv_transfer_params`` dict, verbatim and opaque.
        decode: the router's name of the decode instance holding the blocks.
        decode_epoch: that instance's epoch when the record was written; a later epoch means D
            restarted and the blocks are gone.
        prefill: the prefill instance that served the turn (routing affinity only).
        block_size: D's KV block size in tokens.
        prefix: S_D up to the handle's ``remote_num_tokens``, as a digest chain and tail.
        created_at: wall-clock seconds when written (router clock, shared by replicas).
        shadowed: its blocks are also pinned by a streamed request whose handle the router
            never learns (a tokens-only stream, its handle captured after it): releasing this
            handle frees next to nothing until that pin's TTL, so pressure relief passes it
            by (it is never among ``Store.claim_oldest``'s records).
        expires_at: wall-clock seconds after which the handle must not be sent to P. Set to
            created + ``decoder_kv_blocks_ttl`` - 5 s (vLLM's safety margin) - a queue margin.
    """

    turn: int
    handle: dict[str, Any]
    decode: str
    decode_epoch: int
    prefill: str | None = None
    block_size: int
    prefix: TokenPrefix
    created_at: float
    expires_at: float
    shadowed: bool = False

    def expired(self, now: float) -> bool:
        return now >= self.expires_at

    def expires_in(self, now: float) -> float:
        """Seconds left before expiry (negative once expired)."""
        return self.expires_at - now

    def to_bytes(self) -> bytes:
        return _ENCODER.encode(self)

    @classmethod
    def from_bytes(cls, data: bytes) -> Record:
        try:
            return _DECODER.decode(data)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise RecordDecodeError(str(exc)) from exc


_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(Record)
