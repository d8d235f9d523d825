"""Our own chained block hashes of token ids: the keys of the KV index.

vLLM's block hashes depend on its hash function and ``PYTHONHASHSEED``; the events carry
every stored block's token ids, so the index re-keys blocks by a chain computed here, the
same way for the events and for the prompts it is asked about. A key names a block *and*
everything before it, as a prefix cache does. The hashes live only in this process.
"""

from __future__ import annotations

from collections.abc import Sequence

import xxhash

from carryover.state.prefix import ID_BYTES, pack_ids

__all__ = ["ROOT", "chain_hashes", "chain_of_packed", "salt_root"]

#: The parent of a sequence's first block.
ROOT = 0


def salt_root(salt: str | None) -> int:
    """The parent of a salted sequence's first block: vLLM puts ``cache_salt`` in the first
    block's hash, so blocks of one salt never match a prompt of another (or of none)."""
    if not salt:
        return ROOT
    return xxhash.xxh3_64_intdigest(b"cache_salt\0" + salt.encode())


def chain_hashes(ids: Sequence[int], block_size: int, parent: int = ROOT) -> list[int]:
    """Keys of every full block of ``ids`` (a trailing partial block has none)."""
    return chain_of_packed(pack_ids(ids), block_size, parent)


def chain_of_packed(packed: bytes, block_size: int, parent: int = ROOT) -> list[int]:
    """``chain_hashes`` of ids already packed (``pack_ids``: a turn's ``HashedTokens``)."""
    keys: list[int] = []
    step = block_size * ID_BYTES
    digest = xxhash.xxh3_64_intdigest
    # Slices of bytes: copying 64 bytes is cheaper than a memoryview's slice object.
    for start in range(0, len(packed) - step + 1, step):
        parent = digest(packed[start : start + step], parent)
        keys.append(parent)
    return keys
