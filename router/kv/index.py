"""Which blocks every engine holds, from its KV events; pure, no I/O (docs/kv-events.md).

Each instance's blocks are kept under our chained keys (router/kv/chain.py), so asking how much
of a prompt an instance holds is one walk down the prompt's chain. The engine's own hashes are
kept only to apply ``BlockRemoved`` (which names blocks by them alone).

Memory: an instance holds at most as many blocks as its KV cache (plus offload tiers), and the
index two dict entries per block and tier, and one a block on a device, shared by the
instances (``KvIndex.holders``); ``max_blocks`` is the bound past which an instance's
entries are dropped (it can only be passed when removals were lost).
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from enum import IntFlag, StrEnum
from itertools import accumulate, islice, repeat
from operator import and_

from carryover.router.kv.chain import ROOT, chain_hashes, chain_of_packed, salt_root
from carryover.router.kv.events import (
    AllBlocksCleared,
    BlockHash,
    BlockRemoved,
    BlockStored,
    KVEvent,
)
from carryover.state.prefix import pack_ids

__all__ = ["Cached", "InstanceBlocks", "KvIndex", "Prompt", "Skipped", "Tier"]


class Tier(IntFlag):
    """Where a block is: vLLM's ``medium`` (``GPU``, or ``None`` for the engine's own KV
    cache; ``CPU`` and ``STORAGE`` for offload tiers such as LMCache)."""

    DEVICE = 1
    HOST = 2
    STORAGE = 4

    @classmethod
    def of(cls, medium: str | None) -> Tier:
        if medium is None or medium == "GPU":
            return cls.DEVICE
        return cls.HOST if medium == "CPU" else cls.STORAGE


_DEVICE = int(Tier.DEVICE)


class Skipped(StrEnum):
    """Why stored blocks were not indexed (a metric label)."""

    #: LoRA or multimodal keys: not interchangeable with plain token blocks. (A cache salt
    #: on a prompt's first block is indexed: it roots the chain, router/kv/chain.py.)
    EXTRA_KEYS = "extra_keys"
    #: A second KV cache group (hybrid models): group 0 decides the prefix.
    OTHER_GROUP = "other_group"
    #: The parent block is unknown here (stored before we listened, or already removed).
    UNKNOWN_PARENT = "unknown_parent"
    #: ``token_ids`` do not fill ``block_hashes`` blocks of ``block_size``.
    MALFORMED = "malformed"
    #: An offload tier's blocks of another size than the engine's own (LMCache's 256-token
    #: chunks): skipped here; a model's warm tier indexes them in its own entry (router/kv/warm.py).
    OTHER_BLOCK_SIZE = "other_block_size"


@dataclass(frozen=True, slots=True)
class Cached:
    """The leading blocks of a prompt an instance holds: in any tier, and on the device."""

    tokens: int = 0
    device_tokens: int = 0


def _root_of(event: BlockStored) -> int | None:
    """Where the chain of a stored run starts: its salt's root when the run begins a prompt
    whose first block carries only a cache salt (vLLM publishes the bare salt there,
    ``to_event_extra_keys``); ``None`` for any other extra key (LoRA, multimodal)."""
    if event.lora_name is not None:
        return None
    keys = event.extra_keys
    if keys is None or not any(keys):
        return ROOT
    first, rest = keys[0], keys[1:]
    if any(rest) or event.parent_block_hash is not None or not first or len(first) != 1:
        return None
    salt = first[0]
    return salt_root(salt) if isinstance(salt, str) and salt else None


@dataclass
class InstanceBlocks:
    """One instance's blocks."""

    max_blocks: int = 4_000_000
    block_size: int | None = None
    #: tier -> engine hash -> our key. One dict a tier, not (tier, hash) pairs: a tuple
    #: holding a ``Tier`` stays tracked by the garbage collector, one per block, and every
    #: full collection walks them all (a 100 ms stall of the loop at a fleet's few 100k).
    _keys: dict[Tier, dict[BlockHash, int]] = field(
        default_factory=lambda: {tier: {} for tier in Tier}
    )
    #: our key -> the tiers holding it, as the int of a ``Tier``: ``cached`` walks thousands
    #: of blocks a turn, and an ``IntFlag`` operation builds a new member each time.
    _held: dict[int, int] = field(default_factory=dict)
    skipped: dict[Skipped, int] = field(default_factory=dict)
    overflows: int = 0
    #: our key -> a bit for each instance of the index holding it on the device, shared by
    #: every instance of one ``KvIndex`` (this instance's is ``bit``): one walk down a
    #: prompt's chain answers for all of them (``Prompt.device_blocks``). Ints only: the
    #: collector does not track it.
    holders: dict[int, int] = field(default_factory=dict)
    bit: int = 1

    def __len__(self) -> int:
        return sum(map(len, self._keys.values()))

    def clear(self) -> None:
        self._unhold_device(self._keys[Tier.DEVICE].values())
        for keys in self._keys.values():
            keys.clear()
        self._held.clear()

    def _hold_device(self, keys: Sequence[int]) -> None:
        holders, bit = self.holders, self.bit
        for key in keys:
            holders[key] = holders.get(key, 0) | bit

    def _unhold_device(self, keys: Iterable[int]) -> None:
        holders, others = self.holders, ~self.bit
        for key in keys:
            left = holders.get(key, 0) & others
            if left:
                holders[key] = left
            else:
                holders.pop(key, None)

    def apply(self, event: KVEvent) -> None:
        if isinstance(event, BlockStored):
            self._store(event)
        elif isinstance(event, BlockRemoved):
            self._remove(event)
        elif isinstance(event, AllBlocksCleared):
            self.clear()

    def _skip(self, why: Skipped, blocks: int) -> None:
        self.skipped[why] = self.skipped.get(why, 0) + blocks

    def _store(self, event: BlockStored) -> None:
        count = len(event.block_hashes)
        if event.group_idx not in (None, 0):
            return self._skip(Skipped.OTHER_GROUP, count)
        root = _root_of(event)
        if root is None:
            return self._skip(Skipped.EXTRA_KEYS, count)
        size = event.block_size
        if size <= 0 or len(event.token_ids) != count * size:
            return self._skip(Skipped.MALFORMED, count)
        tier = Tier.of(event.medium)
        if self.block_size != size:
            if tier is not Tier.DEVICE and self.block_size is not None:
                return self._skip(Skipped.OTHER_BLOCK_SIZE, count)
            # The engine's own blocks changed size: a new configuration (a restart).
            self.clear()
            self.block_size = size
        if event.parent_block_hash is None:
            parent = root
        else:
            found = self._parent(event.parent_block_hash, tier)
            if found is None:
                return self._skip(Skipped.UNKNOWN_PARENT, count)
            parent = found
        try:
            chain = chain_hashes(event.token_ids, size, parent)
        except OverflowError:  # an id outside uint32: no model's vocabulary
            return self._skip(Skipped.MALFORMED, count)
        keys, held, bit = self._keys[tier], self._held, int(tier)
        for engine_hash, key in zip(event.block_hashes, chain, strict=True):
            keys[engine_hash] = key
            held[key] = held.get(key, 0) | bit
        if bit == _DEVICE:
            self._hold_device(chain)
        if len(self) > self.max_blocks:
            # Only lost removals get here; stale entries would never leave otherwise.
            self.overflows += 1
            self.clear()

    def hold(self, keys: Sequence[int], tier: Tier) -> None:
        """Blocks known held without an event (their chain ``keys``): what the router saw an
        engine write to a warm tier whose events do not reach it (router/kv/warm.py)."""
        bit, known = int(tier), self._keys[tier]
        for key in keys:
            known[key] = key
            self._held[key] = self._held.get(key, 0) | bit
        if bit == _DEVICE:
            self._hold_device(keys)
        if len(self) > self.max_blocks:
            self.overflows += 1
            self.clear()

    def _parent(self, engine_hash: BlockHash, tier: Tier) -> int | None:
        found = self._keys[tier].get(engine_hash)
        if found is None:
            for keys in self._keys.values():
                found = keys.get(engine_hash)
                if found is not None:
                    break
        return found

    def _remove(self, event: BlockRemoved) -> None:
        if event.group_idx not in (None, 0):
            return
        tier = Tier.of(event.medium)
        bit, known = int(tier), self._keys[tier]
        for engine_hash in event.block_hashes:
            key = known.pop(engine_hash, None)
            if key is None:
                continue
            if bit == _DEVICE:
                self._unhold_device((key,))
            left = self._held.get(key, 0) & ~bit
            if left:
                self._held[key] = left
            else:
                self._held.pop(key, None)

    def cached(self, keys: Sequence[int], device: int | None = None) -> Cached:
        """How many leading blocks of a prompt (its chain ``keys``) this instance holds;
        ``device``: how many of them it holds on the device, when the caller knows."""
        held = self._held
        if device is None:
            device = _leading(_runs(keys, self.holders), self.bit)
        blocks = device
        for key in islice(keys, device, None):
            if key not in held:
                break
            blocks += 1
        size = self.block_size or 0
        return Cached(blocks * size, device * size)


def _runs(keys: Sequence[int], holders: dict[int, int]) -> list[int]:
    """Each key's holder bits, and-ed along the chain (in C): entry ``i`` holds the instances
    holding every block up to ``i``."""
    return list(accumulate(map(holders.get, keys, repeat(0)), and_))


def _leading(runs: list[int], bit: int) -> int:
    """Leading blocks held by the instance of ``bit``: bits only ever clear along ``runs``."""
    return bisect_left(runs, 1, key=lambda held: 0 if held & bit else 1)


class Prompt:
    """A prompt's chain keys (under its cache salt), computed once per block size for every
    instance asked."""

    __slots__ = ("_chains", "_packed", "_runs", "ids", "root")

    def __init__(
        self, ids: Sequence[int], salt: str | None = None, *, packed: bytes | None = None
    ) -> None:
        self.ids = ids
        self.root = salt_root(salt)
        self._packed = packed  # ``pack_ids(ids)``, when the turn has it already
        self._chains: dict[int, list[int]] = {}
        self._runs: dict[int, list[int]] = {}

    def keys(self, block_size: int) -> list[int]:
        keys = self._chains.get(block_size)
        if keys is None:
            if self._packed is None:
                self._packed = pack_ids(self.ids)
            keys = chain_of_packed(self._packed, block_size, self.root)
            self._chains[block_size] = keys
        return keys

    def device_blocks(self, block_size: int, holders: dict[int, int], bit: int) -> int:
        """Leading blocks of the prompt held on the device by the instance of ``bit``, from
        an index's ``holders``, whose chain is looked up once for every instance, on the
        first ask (the turn's view): eight instances each walking a 20k-token prompt's
        1,250 blocks took 0.46-0.60 ms a turn, one walk 0.21-0.25 (bench/RESULTS.md)."""
        runs = self._runs.get(block_size)
        if runs is None:
            runs = self._runs[block_size] = _runs(self.keys(block_size), holders)
        return _leading(runs, bit)


@dataclass
class KvIndex:
    """Every instance's blocks, by instance name. An instance without events has no entry
    (routing treats it by load alone)."""

    max_blocks: int = 4_000_000
    instances: dict[str, InstanceBlocks] = field(default_factory=dict)
    #: our key -> the bits of the instances holding it on the device (``InstanceBlocks.bit``)
    holders: dict[int, int] = field(default_factory=dict)

    def of(self, name: str) -> InstanceBlocks:
        blocks = self.instances.get(name)
        if blocks is None:
            taken = {each.bit for each in self.instances.values()}
            bit = next(1 << n for n in range(len(taken) + 1) if 1 << n not in taken)
            blocks = InstanceBlocks(self.max_blocks, holders=self.holders, bit=bit)
            self.instances[name] = blocks
        return blocks

    def forget(self, name: str) -> None:
        """An instance that left: what is known of it goes, and its bit is free again."""
        blocks = self.instances.pop(name, None)
        if blocks is not None:
            blocks.clear()

    def cached(self, name: str, prompt: Prompt) -> Cached | None:
        """``None``: nothing is known of this instance (no events)."""
        blocks = self.instances.get(name)
        if blocks is None:
            return None
        size = blocks.block_size
        if size is None:
            return Cached()
        device = prompt.device_blocks(size, self.holders, blocks.bit)
        return blocks.cached(prompt.keys(size), device)
