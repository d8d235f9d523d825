"""How a record is stored in Redis: the turn as 8 big-endian bytes, the holding decode
instance's name (2-byte length, then UTF-8), then the msgpack record. The scripts compare turns
and find the holder without decoding msgpack (``state/redis_scripts.py``)."""

from __future__ import annotations

from carryover.state.records import Record, RecordDecodeError

__all__ = ["decode_value", "encode_value"]

_TURN_BYTES = 8
_NAME_LEN_BYTES = 2


def encode_value(record: Record) -> bytes:
    name = record.decode.encode()
    return (
        record.turn.to_bytes(_TURN_BYTES, "big")
        + len(name).to_bytes(_NAME_LEN_BYTES, "big")
        + name
        + record.to_bytes()
    )


def decode_value(value: bytes | str | None) -> Record | None:
    if not isinstance(value, bytes):  # the client never decodes responses; None is a miss
        return None
    start = _TURN_BYTES + _NAME_LEN_BYTES
    start += int.from_bytes(value[_TURN_BYTES:start], "big")
    try:
        return Record.from_bytes(value[start:])
    except RecordDecodeError:
        # A record from another version of the format is a miss, not an outage.
        return None
