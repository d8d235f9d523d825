"""KV-event batches of every shape vLLM publishes, for the encoders' agreement tests: each as
the simulator's events and as plain data any other encoder can build from."""

from __future__ import annotations

from typing import Any

from carryover.bench.sim.kv_wire import Cleared, Removed, SimEvent, Stored

_HASH_A = bytes(range(32))
_HASH_B = bytes(range(1, 33))

#: (ts, events as (class name, fields), data_parallel_rank)
CASES: list[tuple[float, list[tuple[str, dict[str, Any]]], int | None]] = [
    (
        1.5,
        [
            (
                "BlockStored",
                {
                    "block_hashes": [_HASH_A],
                    "parent_block_hash": None,
                    "token_ids": [1, 2, 3, 4],
                    "block_size": 4,
                    "lora_id": None,
                    "medium": "GPU",
                    "lora_name": None,
                },
            )
        ],
        0,
    ),
    (
        1_765_000_000.25,
        [
            (
                "BlockStored",
                {
                    "block_hashes": [_HASH_A, _HASH_B],
                    "parent_block_hash": None,
                    "token_ids": list(range(8)),
                    "block_size": 4,
                    "lora_id": None,
                    "medium": "GPU",
                    "lora_name": None,
                    "extra_keys": [("t0123abc",), None],
                },
            ),
            ("BlockRemoved", {"block_hashes": [_HASH_B], "medium": "GPU"}),
            ("AllBlocksCleared", {}),
        ],
        None,
    ),
    (
        2.0,
        [
            (
                "BlockStored",
                {
                    "block_hashes": [123456789, -5],
                    "parent_block_hash": 42,
                    "token_ids": list(range(16)),
                    "block_size": 8,
                    "lora_id": None,
                    "medium": "CPU",
                    "lora_name": None,
                },
            )
        ],
        3,
    ),
]

_SIM = {"BlockStored": Stored, "BlockRemoved": Removed, "AllBlocksCleared": Cleared}


def sim_events(events: list[tuple[str, dict[str, Any]]]) -> list[SimEvent]:
    return [_SIM[name](**fields) for name, fields in events]
