"""Redis Cluster's key slots, and the hash tags that spread the store's shards over them.

A key's slot is CRC16 (XMODEM) of the key, or of the part inside the first non-empty
``{…}`` (its hash tag), modulo 16384 (the Cluster specification, "Keys distribution model").
Keys that share a tag share a slot, so a script may touch them together.
"""

from __future__ import annotations

from functools import cache

__all__ = ["MAX_SHARDS", "SLOTS", "key_slot", "shard_tags"]

SLOTS = 16384
MAX_SHARDS = 256  #: finding the tags costs shards² CRCs; 256 take ~0.1 s at startup


def _table() -> list[int]:
    table = []
    for byte in range(256):
        crc = byte << 8
        for _ in range(8):
            crc = ((crc << 1) ^ 0x1021) if crc & 0x8000 else crc << 1
        table.append(crc & 0xFFFF)
    return table


_CRC16 = _table()


def _crc16(data: bytes) -> int:
    crc = 0
    for byte in data:
        crc = ((crc << 8) & 0xFFFF) ^ _CRC16[((crc >> 8) ^ byte) & 0xFF]
    return crc


def key_slot(key: bytes | str) -> int:
    """The Cluster slot of ``key``."""
    data = key.encode() if isinstance(key, str) else key
    start = data.find(b"{")
    if start >= 0:
        end = data.find(b"}", start + 1)
        if end > start + 1:
            data = data[start + 1 : end]
    return _crc16(data) % SLOTS


@cache
def shard_tags(shards: int) -> tuple[str, ...]:
    """One hash tag per shard, shard ``i``'s slot inside the ``i``-th of ``shards`` equal
    ranges of slots. ``redis-cli --cluster create`` and ``reshard`` hand out contiguous
    ranges, so the shards spread over the primaries as evenly as the slots do; every router
    computes the same tags."""
    if not 1 <= shards <= MAX_SHARDS:
        raise ValueError(f"shards must be between 1 and {MAX_SHARDS}")
    tags = []
    for shard in range(shards):
        low, high = shard * SLOTS // shards, (shard + 1) * SLOTS // shards
        suffix = 0
        while not low <= key_slot(tag := f"s{shard}.{suffix}") < high:
            suffix += 1
        tags.append(tag)
    return tuple(tags)
