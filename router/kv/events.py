"""vLLM's KV-cache event wire format, mirrored (docs/kv-events.md).

An engine started with ``--kv-events-config '{"enable_kv_cache_events": true, "publisher":
"zmq", ...}'`` publishes on a PUB socket three frames per message: the topic, an 8-byte
big-endian sequence number, and a msgpack ``KVEventBatch``. The batch is an array
``[ts, events, data_parallel_rank]``; events are maps tagged by class name under ``"type"``
with default fields left out (vllm/distributed/kv_events.py, vLLM 0.32 and 0.33).

Fields the router does not read are still declared, so that a batch we encode (the simulator)
is what vLLM would send, and unknown fields from newer engines are ignored, not fatal.
"""

from __future__ import annotations

from typing import Any

import msgspec

__all__ = [
    "END_SEQ",
    "AllBlocksCleared",
    "BlockHash",
    "BlockRemoved",
    "BlockStored",
    "KVEvent",
    "KVEventBatch",
    "decode_batch",
    "encode_batch",
]

#: vLLM's external block hash: bytes (sha256-based hashes) or an int (builtin hash).
BlockHash = bytes | int

#: The sequence number of the replay socket's end-of-replay marker (signed -1).
END_SEQ = -1


class _Event(msgspec.Struct, omit_defaults=True, tag=True, gc=False):
    pass


class BlockStored(_Event):
    """Full blocks entered an engine's prefix cache; ``token_ids`` are all their tokens in
    order, ``parent_block_hash`` is the block before the first (``None``: the prompt's start)."""

    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    # One entry per block: LoRA name, multimodal ids, cache salt. A block with extra keys is
    # not interchangeable with one of the same tokens without them.
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None


class BlockRemoved(_Event):
    block_hashes: list[BlockHash]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(_Event):
    pass


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[KVEvent]
    data_parallel_rank: int | None = None


class _LooseBatch(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[msgspec.Raw]
    data_parallel_rank: int | None = None


_decoder = msgspec.msgpack.Decoder(KVEventBatch)
_loose_decoder = msgspec.msgpack.Decoder(_LooseBatch)
_event_decoder: msgspec.msgpack.Decoder[KVEvent] = msgspec.msgpack.Decoder(KVEvent)
_encoder = msgspec.msgpack.Encoder()


def decode_batch(payload: bytes) -> tuple[KVEventBatch, int]:
    """The batch and how many of its events were skipped: an event type or shape this
    version does not know (a newer engine) costs that event, not the batch.

    Raises ``msgspec.DecodeError`` (a ``ValueError``) on a payload that is not a batch at all.
    """
    try:
        return _decoder.decode(payload), 0
    except msgspec.DecodeError:
        loose = _loose_decoder.decode(payload)
    events: list[KVEvent] = []
    for raw in loose.events:
        try:
            events.append(_event_decoder.decode(raw))
        except msgspec.DecodeError:
            continue
    skipped = len(loose.events) - len(events)
    return KVEventBatch(loose.ts, events, loose.data_parallel_rank), skipped


def encode_batch(batch: KVEventBatch) -> bytes:
    return _encoder.encode(batch)
