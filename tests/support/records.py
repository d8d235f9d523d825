"""Records for tests, built through the same code the router uses."""

from __future__ import annotations

import time
from typing import Any

from carryover.state import HashedTokens, Record


def make_record(
    turn: int = 1,
    *,
    tokens: list[int] | None = None,
    ttl: float = 60.0,
    decode: str = "d0",
    epoch: int = 0,
    block_size: int = 16,
) -> Record:
    ids = tokens if tokens is not None else list(range(100 + turn))
    handle: dict[str, Any] = {
        "do_remote_decode": True,
        "do_remote_prefill": False,
        "remote_block_ids": [list(range(-(-len(ids) // block_size)))],
        "remote_engine_id": "e",
        "remote_request_id": f"r{turn}",
        "remote_host": "localhost",
        "remote_port": 5600,
        "remote_num_tokens": len(ids),
    }
    now = time.time()
    return Record(
        turn=turn,
        handle=handle,
        decode=decode,
        decode_epoch=epoch,
        block_size=block_size,
        prefix=HashedTokens(ids, 256).prefix(len(ids), output_start=len(ids) // 2),
        created_at=now,
        expires_at=now + ttl,
    )
