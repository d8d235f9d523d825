"""KV-cache events as the simulator publishes them, encoded from vLLM's wire format.

Written apart from the router's decoder on purpose (the router is tested against what this
sends). vLLM 0.32 and 0.33 (``vllm/distributed/kv_events.py``) publish a msgpack
``KVEventBatch``: a msgspec Struct with ``array_like=True``, so an array
``[ts, events, data_parallel_rank]``, all three always written (msgspec's ``omit_defaults``
leaves nothing out of an array; ``None`` is nil). Each event
is a Struct with ``tag=True, omit_defaults=True``: a map whose first key is ``"type"`` (the
class name), then the fields in declaration order, the fields that have a default left out
while they hold it (fields without a default always written, ``None`` included).

``tests/unit/sim/test_kv_wire.py`` checks these bytes against the router's encoder, and the
real tier against vLLM's own classes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, TypeAlias

import msgspec

__all__ = ["END_SEQ", "Cleared", "Removed", "SimEvent", "Stored", "encode_batch"]

#: The sequence number of the replay socket's end-of-replay marker (signed -1).
END_SEQ = -1

_pack = msgspec.msgpack.Encoder()


@dataclass(frozen=True)
class Stored:
    """vLLM's ``BlockStored``: its fields in its order."""

    block_hashes: list[bytes | int]
    parent_block_hash: bytes | int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = "GPU"
    lora_name: str | None = None
    extra_keys: list[tuple[Any, ...] | None] | None = None  # has a default in vLLM: None

    def wire(self) -> dict[str, Any]:
        fields: dict[str, Any] = {
            "type": "BlockStored",
            "block_hashes": self.block_hashes,
            "parent_block_hash": self.parent_block_hash,
            "token_ids": self.token_ids,
            "block_size": self.block_size,
            "lora_id": self.lora_id,
            "medium": self.medium,
            "lora_name": self.lora_name,
        }
        if self.extra_keys is not None:
            fields["extra_keys"] = [list(k) if k is not None else None for k in self.extra_keys]
        return fields


@dataclass(frozen=True)
class Removed:
    """vLLM's ``BlockRemoved``."""

    block_hashes: list[bytes | int]
    medium: str | None = "GPU"

    def wire(self) -> dict[str, Any]:
        return {"type": "BlockRemoved", "block_hashes": self.block_hashes, "medium": self.medium}


@dataclass(frozen=True)
class Cleared:
    """vLLM's ``AllBlocksCleared``."""

    def wire(self) -> dict[str, Any]:
        return {"type": "AllBlocksCleared"}


SimEvent: TypeAlias = Stored | Removed | Cleared


def encode_batch(ts: float, events: list[SimEvent], data_parallel_rank: int | None) -> bytes:
    return _pack.encode([ts, [event.wire() for event in events], data_parallel_rank])
