"""The simulated KV cache: a paged block pool whose blocks hold *what they were computed from*.

A block's content is a digest chained over every token before it and in it (its KV depends on
the whole prefix, as attention makes real KV do). Computing tokens locally extends that chain;
loading a block from another instance copies the other instance's content as it is. So a load of
blocks computed for other tokens (vLLM #43094) leaves content that no local computation of this
prompt would give, and every output derived from it differs: a wrong reuse gives a wrong answer.

When everything was computed correctly, a full block's content equals the hash of its tokens,
which is also its prefix-cache key. Blocks pulled from elsewhere are cached under the *local*
prompt's token hashes, as vLLM does, so a wrong pull poisons later requests.
"""

from __future__ import annotations

import array
from collections import OrderedDict
from collections.abc import Sequence

import xxhash

from carryover.bench.sim.kv_wire import Cleared, Removed, SimEvent, Stored

__all__ = ["SEED", "BlockPool", "OutOfBlocks", "chain", "salt_seed", "token_hashes"]

SEED = b"\x00" * 16


def _pack(tokens: Sequence[int]) -> bytes:
    return array.array("I", tokens).tobytes()


def chain(previous: bytes, tokens: Sequence[int]) -> bytes:
    """Content of a block whose predecessor has content ``previous`` and which holds ``tokens``,
    all computed locally."""
    digest: bytes = xxhash.xxh3_128(previous + _pack(tokens)).digest()
    return digest


def salt_seed(salt: str | None) -> bytes:
    """The key before a prompt's first block: vLLM hashes ``cache_salt`` into the first
    block's key (``generate_block_hash_extra_keys``), so a salted prompt shares no block with
    the same tokens under another salt. The KV values themselves do not depend on it."""
    if not salt:
        return SEED
    digest: bytes = xxhash.xxh3_128(b"cache_salt\0" + salt.encode()).digest()
    return digest


def token_hashes(tokens: Sequence[int], block_size: int, salt: str | None = None) -> list[bytes]:
    """Prefix-cache keys of every full block of ``tokens`` (under ``salt``)."""
    hashes: list[bytes] = []
    previous = salt_seed(salt)
    for start in range(0, len(tokens) - block_size + 1, block_size):
        previous = chain(previous, tokens[start : start + block_size])
        hashes.append(previous)
    return hashes


class OutOfBlocks(Exception):
    """Not enough free blocks: the request waits."""


class BlockPool:
    """Reference-counted blocks, an LRU of free ones, and a prefix cache over full blocks."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        *,
        prefix_caching: bool = True,
        events: bool = False,
    ) -> None:
        self.block_size = block_size
        # What entered and left the prefix cache since the last ``take_events`` (vLLM's KV
        # events), when events are on.
        self.events: list[SimEvent] | None = [] if events else None
        self.num_blocks = num_blocks
        self.prefix_caching = prefix_caching
        self.content: list[bytes] = [SEED] * num_blocks
        self.refs = [0] * num_blocks
        self.key: list[bytes | None] = [None] * num_blocks  # prefix-cache key, if cached
        self._free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))
        self._cache: dict[bytes, int] = {}

    @property
    def used(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def cached_blocks(self) -> int:
        return len(self._cache)

    def usage(self) -> float:
        return self.used / self.num_blocks

    def lookup(self, hashes: Sequence[bytes], limit: int) -> list[int]:
        """Cached blocks for the leading ``hashes`` (at most ``limit`` blocks), referenced."""
        if not self.prefix_caching:
            return []
        found: list[int] = []
        for digest in hashes[:limit]:
            block = self._cache.get(digest)
            if block is None:
                break
            found.append(block)
        for block in found:
            self._ref(block)
        return found

    def _ref(self, block: int) -> None:
        if self.refs[block] == 0:
            self._free.pop(block, None)
        self.refs[block] += 1

    def allocate(self, count: int) -> list[int]:
        if count > len(self._free):
            raise OutOfBlocks(f"need {count} blocks, {len(self._free)} free")
        blocks = []
        for _ in range(count):
            block, _ = self._free.popitem(last=False)  # least recently freed first
            old = self.key[block]
            if old is not None and self._cache.get(old) == block:
                del self._cache[old]
                if self.events is not None:
                    self.events.append(Removed(block_hashes=[old], medium="GPU"))
            self.key[block] = None
            self.content[block] = SEED
            self.refs[block] = 1
            blocks.append(block)
        return blocks

    def cache(self, blocks: Sequence[int], tokens: Sequence[int], salt: str | None = None) -> None:
        """Enter the full blocks of ``tokens`` into the prefix cache under their token hashes
        (salted by ``salt``)."""
        if not self.prefix_caching:
            return
        hashes = token_hashes(tokens, self.block_size, salt)
        stored: list[int] = []  # indices of blocks new to the cache
        for index, (block, digest) in enumerate(zip(blocks, hashes, strict=False)):
            if digest not in self._cache:
                self._cache[digest] = block
                self.key[block] = digest
                stored.append(index)
        if self.events is not None and stored:
            self._stored(stored, hashes, tokens, salt)

    def _stored(
        self, indices: list[int], hashes: list[bytes], tokens: Sequence[int], salt: str | None
    ) -> None:
        """One ``BlockStored`` per run of consecutive new blocks, as vLLM sends them."""
        assert self.events is not None
        size = self.block_size
        runs: list[list[int]] = []
        for index in indices:
            if runs and runs[-1][-1] == index - 1:
                runs[-1].append(index)
            else:
                runs.append([index])
        for run in runs:
            first, last = run[0], run[-1]
            self.events.append(
                Stored(
                    block_hashes=[hashes[i] for i in run],
                    parent_block_hash=hashes[first - 1] if first else None,
                    token_ids=list(tokens[first * size : (last + 1) * size]),
                    block_size=size,
                    lora_id=None,
                    medium="GPU",
                    lora_name=None,
                    # As vLLM publishes them: the bare salt on the prompt's first block only.
                    extra_keys=[(salt,) if i == 0 else None for i in run]
                    if salt and first == 0
                    else None,
                )
            )

    def take_events(self) -> list[SimEvent]:
        if not self.events:
            return []
        taken, self.events = self.events, []
        return taken

    def release(self, blocks: Sequence[int]) -> None:
        for block in blocks:
            self.refs[block] -= 1
            if self.refs[block] == 0:
                self._free[block] = None  # cached blocks stay findable until reallocated

    def clear_cache(self) -> None:
        self._cache.clear()
        self.key = [None] * self.num_blocks
        if self.events is not None:
            self.events = [Cleared()]

    def compute(self, blocks: Sequence[int], tokens: Sequence[int], start: int, end: int) -> None:
        """Compute KV for ``tokens[start:end]`` locally into ``blocks``.

        A block that already holds loaded content for its first tokens keeps the effect of that
        content: if it is not what local computation would have given, the block stays wrong.
        """
        size = self.block_size
        position = start
        while position < end:
            index = position // size
            block_start = index * size
            block_end = min(block_start + size, end)
            previous = self.content[blocks[index - 1]] if index else SEED
            if position > block_start:
                current = self.content[blocks[index]]
                if current == chain(previous, tokens[block_start:position]):
                    value = chain(previous, tokens[block_start:block_end])
                else:
                    corrupt = b"x" + current + _pack(tokens[position:block_end])
                    value = xxhash.xxh3_128(corrupt).digest()
            else:
                value = chain(previous, tokens[block_start:block_end])
            self.content[blocks[index]] = value
            position = block_end

    def fingerprint(self, blocks: Sequence[int], length: int) -> bytes:
        """What the model attends to after ``length`` tokens: the content of every block that
        holds them. All of them, not the last alone: blocks loaded from elsewhere are copied,
        not chained, so one wrong block among loaded ones leaves the last block as it should
        be, and attention still reads the wrong one."""
        if length == 0:
            return SEED
        held = blocks[: (length - 1) // self.block_size + 1]
        digest: bytes = xxhash.xxh3_128(b"".join(self.content[b] for b in held)).digest()
        return digest
