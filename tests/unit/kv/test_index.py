"""The KV index answers what the engine's events say it holds (router/kv/index.py)."""

from __future__ import annotations

import gc
import hashlib

from hypothesis import given
from hypothesis import strategies as st

from carryover.router.kv.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    decode_batch,
    encode_batch,
)
from carryover.router.kv.index import Cached, InstanceBlocks, KvIndex, Prompt, Skipped
from carryover.state.prefix import HashedTokens

SIZE = 4


def engine_hash(parent: bytes | None, tokens: list[int]) -> bytes:
    """A stand-in for vLLM's hash: any injective function of the chain will do."""
    return hashlib.sha256((parent or b"") + bytes(str(tokens), "ascii")).digest()


def hashes_of(ids: list[int], blocks: int) -> list[bytes]:
    """The engine's hashes of the first ``blocks`` blocks of ``ids``."""
    out: list[bytes] = []
    parent: bytes | None = None
    for b in range(blocks):
        parent = engine_hash(parent, ids[b * SIZE : (b + 1) * SIZE])
        out.append(parent)
    return out


def stored(
    ids: list[int], start_block: int, blocks: int, medium: str | None = "GPU", **extra: object
) -> BlockStored:
    """A BlockStored for blocks ``start_block .. start_block + blocks`` of ``ids``."""
    hashes = hashes_of(ids, start_block + blocks)
    return BlockStored(
        block_hashes=hashes[start_block:],
        parent_block_hash=hashes[start_block - 1] if start_block else None,
        token_ids=ids[start_block * SIZE : (start_block + blocks) * SIZE],
        block_size=SIZE,
        lora_id=None,
        medium=medium,
        lora_name=None,
        **extra,  # type: ignore[arg-type]
    )


PROMPT = list(range(100, 124))  # six blocks


def test_stored_blocks_are_found_as_a_prefix_and_removed_ones_are_not() -> None:
    index = KvIndex()
    blocks = index.of("p0")
    blocks.apply(stored(PROMPT, 0, 2))
    blocks.apply(stored(PROMPT, 2, 2))  # a later event continues the chain through its parent
    assert index.cached("p0", Prompt(PROMPT + [1, 2])) == Cached(16, 16)
    # Another prompt that diverges inside block 2 shares two blocks.
    other = PROMPT[:9] + [7] + PROMPT[10:]
    assert index.cached("p0", Prompt(other)) == Cached(8, 8)
    blocks.apply(BlockRemoved(block_hashes=hashes_of(PROMPT, 2)[1:], medium="GPU"))
    assert index.cached("p0", Prompt(PROMPT)) == Cached(4, 4)
    blocks.apply(AllBlocksCleared())
    assert index.cached("p0", Prompt(PROMPT)) == Cached(0, 0)
    assert index.cached("unknown", Prompt(PROMPT)) is None  # no events: nothing known


def test_offloaded_blocks_count_but_not_as_device_blocks() -> None:
    blocks = InstanceBlocks()
    blocks.apply(stored(PROMPT, 0, 1))
    blocks.apply(stored(PROMPT, 1, 2, medium="CPU"))
    assert blocks.cached(Prompt(PROMPT).keys(SIZE)) == Cached(12, 4)
    # Removed from the device but kept on the host: still there.
    blocks.apply(stored(PROMPT, 1, 2))
    blocks.apply(BlockRemoved(block_hashes=hashes_of(PROMPT, 3)[1:], medium="CPU"))
    assert blocks.cached(Prompt(PROMPT).keys(SIZE)) == Cached(12, 12)


def test_blocks_that_are_not_plain_token_blocks_are_skipped() -> None:
    blocks = InstanceBlocks()
    blocks.apply(stored(PROMPT, 0, 1, extra_keys=[("image-1", 0)]))
    blocks.apply(stored(PROMPT, 0, 1, group_idx=1))
    assert blocks.cached(Prompt(PROMPT).keys(SIZE)).tokens == 0
    # A chain whose parent was never seen cannot be keyed.
    blocks.apply(stored(PROMPT, 1, 1))
    assert blocks.skipped == {
        Skipped.EXTRA_KEYS: 1,
        Skipped.OTHER_GROUP: 1,
        Skipped.UNKNOWN_PARENT: 1,
    }
    assert len(blocks) == 0


def test_a_block_of_ids_outside_any_vocabulary_is_skipped_not_fatal() -> None:
    blocks = InstanceBlocks()
    blocks.apply(stored([2**32, *PROMPT[1:]], 0, 1))
    blocks.apply(stored([-1, *PROMPT[1:]], 0, 1))
    assert blocks.skipped == {Skipped.MALFORMED: 2}
    blocks.apply(stored(PROMPT, 0, 2))
    assert blocks.cached(Prompt(PROMPT).keys(SIZE)).tokens == 2 * SIZE


def test_a_prompt_packed_by_the_turn_has_the_keys_of_its_ids() -> None:
    packed = HashedTokens(PROMPT, 8).packed
    assert Prompt(PROMPT, "salt", packed=packed).keys(SIZE) == Prompt(PROMPT, "salt").keys(SIZE)


def test_salted_blocks_match_only_prompts_of_their_salt() -> None:
    """vLLM publishes a cache salt as the bare salt in the first block's extra keys; the
    blocks after it carry none and chain from it."""
    blocks = InstanceBlocks()
    blocks.apply(stored(PROMPT, 0, 2, extra_keys=[("tenant-a",), None]))
    blocks.apply(stored(PROMPT, 2, 1))
    assert blocks.cached(Prompt(PROMPT, "tenant-a").keys(SIZE)).tokens == 3 * SIZE
    assert blocks.cached(Prompt(PROMPT, "tenant-b").keys(SIZE)).tokens == 0
    assert blocks.cached(Prompt(PROMPT).keys(SIZE)).tokens == 0
    # A salt anywhere but on a prompt's first block is not vLLM's shape: skipped.
    blocks.apply(stored(PROMPT, 3, 1, extra_keys=[("tenant-a",)]))
    assert blocks.skipped == {Skipped.EXTRA_KEYS: 1}


def test_a_new_block_size_drops_what_was_known_and_overflow_clears() -> None:
    blocks = InstanceBlocks(max_blocks=3)
    blocks.apply(stored(PROMPT, 0, 2))
    assert len(blocks) == 2
    blocks.apply(stored(PROMPT, 2, 2))  # 4 > 3: removals were lost, start over
    assert len(blocks) == 0 and blocks.overflows == 1
    blocks.apply(stored(PROMPT, 0, 1))
    bigger = BlockStored([b"x"], None, PROMPT[:8], 8, None, "GPU", None)
    blocks.apply(bigger)
    assert blocks.block_size == 8 and len(blocks) == 1


def test_offloaded_chunks_of_another_size_leave_the_engines_own_blocks_alone() -> None:
    # LMCache's MP connector reports its 256-token chunks (medium CPU) in the same stream as
    # the engine's own 16- or 128-token blocks; they are not a new configuration.
    blocks = InstanceBlocks()
    blocks.apply(stored(PROMPT, 0, 2))
    chunk = BlockStored([b"c0"], None, PROMPT[:8], 8, None, "CPU", None)
    blocks.apply(chunk)
    assert blocks.block_size == SIZE and len(blocks) == 2
    assert blocks.skipped == {Skipped.OTHER_BLOCK_SIZE: 1}
    assert blocks.cached(Prompt(PROMPT).keys(SIZE)) == Cached(8, 8)


def test_a_batch_round_trips_in_vllms_wire_shape_and_unknown_events_are_skipped() -> None:
    import msgspec

    batch = KVEventBatch(1.5, [stored(PROMPT, 0, 1), AllBlocksCleared()])
    payload = encode_batch(batch)
    # vLLM's shape: [ts, [ {"type": "BlockStored", ...}, {"type": "AllBlocksCleared"} ]]
    raw = msgspec.msgpack.decode(payload)
    assert raw[0] == 1.5 and raw[1][0]["type"] == "BlockStored"
    assert raw[1][1] == {"type": "AllBlocksCleared"}
    assert decode_batch(payload) == (batch, 0)
    newer = msgspec.msgpack.encode([2.0, [{"type": "BlockPinned", "x": 1}, raw[1][1]], 0])
    decoded, skipped = decode_batch(newer)
    assert decoded.events == [AllBlocksCleared()] and skipped == 1


@given(
    st.lists(
        st.tuples(st.integers(0, 2), st.lists(st.integers(0, 3), min_size=0, max_size=6)),
        min_size=1,
        max_size=8,
    ),
    st.lists(st.tuples(st.integers(0, 2), st.integers(0, 7)), max_size=8),
    st.lists(st.integers(0, 2), max_size=2),
    st.lists(st.integers(0, 3), min_size=0, max_size=24),
)
def test_the_index_agrees_with_a_model_of_each_instances_cache(
    prompts: list[tuple[int, list[int]]],
    removals: list[tuple[int, int]],
    cleared: list[int],
    query: list[int],
) -> None:
    """Three instances of one index, each storing some prompts' blocks and removing some by
    hash (parents before their children too), one perhaps cleared or forgotten; each
    instance's answer is the longest run of leading blocks of the query it still holds, and
    a lone instance's (``InstanceBlocks``, its own walk) is the same."""
    index = KvIndex()
    bits = [index.of(f"i{n}").bit for n in range(3)]
    alone = [InstanceBlocks() for _ in range(3)]
    present: list[set[tuple[int, ...]]] = [set() for _ in range(3)]  # prefixes held
    every: list[list[tuple[bytes, tuple[int, ...]]]] = [[] for _ in range(3)]
    for n, raw in prompts:
        ids = [t for t in raw for _ in range(SIZE)]  # whole blocks
        blocks = len(ids) // SIZE
        if blocks == 0:
            continue
        index.of(f"i{n}").apply(stored(ids, 0, blocks))
        alone[n].apply(stored(ids, 0, blocks))
        for b, h in enumerate(hashes_of(ids, blocks)):
            prefix = tuple(ids[: (b + 1) * SIZE])
            present[n].add(prefix)
            every[n].append((h, prefix))
    for n, r in removals:
        if r < len(every[n]):
            h, prefix = every[n][r]
            index.of(f"i{n}").apply(BlockRemoved([h], "GPU"))
            alone[n].apply(BlockRemoved([h], "GPU"))
            present[n].discard(prefix)
    for n in cleared:
        index.forget(f"i{n}") if n == 2 else index.of(f"i{n}").apply(AllBlocksCleared())
        alone[n].clear()
        present[n].clear()
    q = [t for t in query for _ in range(SIZE)]
    prompt = Prompt(q)
    for n in range(3):
        expected = 0
        while expected + SIZE <= len(q) and tuple(q[: expected + SIZE]) in present[n]:
            expected += SIZE
        assert alone[n].cached(prompt.keys(SIZE)) == Cached(expected, expected)  # all on device
        if f"i{n}" in index.instances:
            assert index.cached(f"i{n}", prompt) == Cached(expected, expected)
        else:
            assert index.cached(f"i{n}", prompt) is None
            assert not any(held & bits[n] for held in index.holders.values())


def test_a_forgotten_instances_bit_is_free_for_the_next_and_holds_nothing() -> None:
    index = KvIndex()
    index.of("p0").apply(stored(PROMPT, 0, 6))
    index.of("p1").apply(stored(PROMPT, 0, 3))
    index.forget("p0")
    assert set(index.holders.values()) == {index.of("p1").bit}
    newcomer = index.of("p2")
    assert newcomer.bit == 1  # p0's, free again
    assert index.cached("p2", Prompt(PROMPT)) == Cached(0, 0)
    assert index.cached("p1", Prompt(PROMPT)) == Cached(12, 12)


def test_the_index_leaves_the_garbage_collector_nothing_to_trace() -> None:
    """Every full collection walks each object the collector tracks: an index of a fleet's
    blocks (hundreds of thousands) must not add one per block, or the router's loop stalls
    for a collection's length (tens of ms) under load."""
    ids = list(range(4 * 2_000))
    blocks = InstanceBlocks()
    blocks.apply(stored(ids, 0, 1_000))
    blocks.apply(stored(ids, 0, 1_000, medium="CPU"))
    gc.collect()
    before = len(gc.get_objects())
    blocks.apply(stored(ids, 1_000, 1_000))
    blocks.apply(stored(ids, 1_000, 1_000, medium="CPU"))
    blocks.apply(BlockRemoved(block_hashes=hashes_of(ids, 10)[:5], medium="CPU"))
    gc.collect()
    assert len(gc.get_objects()) - before < 50
    # ... nor a tracked container the size of the index, whose members a pass would visit.
    assert traced_references(blocks) < 100
    assert blocks.cached(Prompt(ids).keys(SIZE)) == Cached(len(ids), len(ids))


def traced_references(root: object) -> int:
    """How many references a full collection follows from ``root``: the referents of every
    object reachable from it that the collector tracks (classes and what they reach left
    out: they are the program's, not the index's)."""
    seen: set[int] = set()
    waiting, followed = [root], 0
    while waiting:
        item = waiting.pop()
        if id(item) in seen or not gc.is_tracked(item) or isinstance(item, type):
            continue
        seen.add(id(item))
        referents = gc.get_referents(item)
        followed += len(referents)
        waiting.extend(referents)
    return followed
