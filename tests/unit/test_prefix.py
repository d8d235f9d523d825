"""The prefix check against a brute-force reference, and the vLLM facts it rests on."""

from __future__ import annotations

from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from carryover.state import (
    HashedTokens,
    Path,
    PlanSettings,
    Reason,
    TokenPrefix,
    block_size_of,
    chunk_size_for,
    release_handle,
    truncate_handle,
)
from carryover.state.prefix import plan_reuse


def make_handle(tokens: int, block_size: int, groups: int = 1) -> dict[str, Any]:
    blocks = -(-tokens // block_size)
    return {
        "do_remote_prefill": False,
        "do_remote_decode": True,
        "remote_block_ids": [[100 * g + i for i in range(blocks)] for g in range(groups)],
        "remote_engine_id": "engine-d",
        "remote_request_id": "cmpl-1",
        "remote_host": "localhost",
        "remote_port": 5600,
        "tp_size": 1,
        "remote_num_tokens": tokens,
        "remote_blocks_expiry_time": 1234.5,
    }


def lcp(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def reference(
    stored: list[int],
    output_start: int,
    block: int,
    chunk: int,
    prompt: list[int],
    cfg: PlanSettings,
) -> tuple[Path, Reason | None, int]:
    """What the plan must be, computed the slow obvious way."""
    total = len(stored)
    exact = lcp(prompt, stored)
    whole = (total // chunk) * chunk
    known = exact if exact >= whole else (exact // chunk) * chunk
    if exact == total:
        if total == 0 or total < cfg.recompute_threshold:
            return Path.RELEASE, Reason.BELOW_THRESHOLD, 0
        return Path.REUSE, None, total
    size = len(prompt)
    if size < total and (known == size or (size < whole and known == size - size % chunk)):
        reason = Reason.PROMPT_SHORTER
    elif len(prompt) >= output_start and exact >= output_start:
        reason = Reason.DIVERGED_IN_LAST_OUTPUT
    else:
        reason = Reason.DIVERGED_IN_HISTORY
    usable = min(known, len(prompt) - 1)
    usable -= usable % block
    if not cfg.partial_reuse or usable <= 0 or usable < cfg.recompute_threshold:
        return Path.RELEASE, reason, 0
    return Path.PARTIAL, reason, usable


tokens = st.lists(st.integers(0, 3), max_size=300)


@st.composite
def cases(draw: st.DrawFn) -> tuple[list[int], int, int, int, list[int], PlanSettings]:
    block = draw(st.sampled_from([1, 2, 4, 16, 128]))
    chunk = chunk_size_for(block, draw(st.sampled_from([1, 8, 32, 256])))
    stored = draw(tokens)
    output_start = draw(st.integers(0, len(stored)))
    kind = draw(st.sampled_from(["extend", "prefix", "edit", "drop", "random", "same"]))
    if kind == "extend":
        prompt = stored + draw(tokens)
    elif kind == "prefix":
        prompt = stored[: draw(st.integers(0, len(stored)))]
    elif kind == "edit" and stored:
        at = draw(st.integers(0, len(stored) - 1))
        prompt = [*stored[:at], stored[at] + 1, *stored[at + 1 :], *draw(tokens)]
    elif kind == "drop" and stored:
        lo = draw(st.integers(0, len(stored) - 1))
        hi = draw(st.integers(lo + 1, len(stored)))
        prompt = stored[:lo] + stored[hi:] + draw(tokens)
    elif kind == "same":
        prompt = list(stored)
    else:
        prompt = draw(tokens)
    cfg = PlanSettings(
        partial_reuse=draw(st.booleans()), recompute_threshold=draw(st.sampled_from([0, 1, 64]))
    )
    return stored, output_start, block, chunk, prompt, cfg


@settings(max_examples=600, deadline=None)
@given(cases(), st.integers(1, 3))
def test_plan_matches_reference(
    case: tuple[list[int], int, int, int, list[int], PlanSettings], groups: int
) -> None:
    stored, output_start, block, chunk, prompt, cfg = case
    prefix = HashedTokens(stored, chunk).prefix(len(stored), output_start=output_start)
    handle = make_handle(len(stored), block, groups)
    result = plan_reuse(prefix, handle, block, HashedTokens(prompt, chunk), cfg)
    path, reason, reused = reference(stored, output_start, block, chunk, prompt, cfg)
    assert (result.path, result.reason, result.reused_tokens) == (path, reason, reused)

    # The safety property, stated on its own: whatever is attached matches the prompt exactly.
    if result.path in (Path.REUSE, Path.PARTIAL):
        assert result.handle is not None
        r = result.handle["remote_num_tokens"]
        assert r == result.reused_tokens > 0
        assert prompt[:r] == stored[:r] and len(prompt) >= r
        for group in result.handle["remote_block_ids"]:
            assert len(group) == -(-r // block)
        if result.path is Path.PARTIAL:
            assert r % block == 0 and r < len(prompt)
    elif result.path is Path.RELEASE:
        assert result.handle is not None and result.handle["remote_num_tokens"] == 0


@settings(max_examples=200, deadline=None)
@given(tokens, tokens, st.sampled_from([1, 3, 16, 256]))
def test_extended_hashing_equals_hashing_at_once(a: list[int], b: list[int], chunk: int) -> None:
    assert HashedTokens(a, chunk).extended(b).digests == HashedTokens(a + b, chunk).digests
    assert HashedTokens(a, chunk).extended(b).tokens() == a + b


def test_shorter_prompt_that_is_an_exact_prefix_is_not_full_reuse() -> None:
    # vLLM end-trims D's block list: a prompt needing fewer blocks gets D's *tail* blocks
    # (docs/vllm-protocol.md §3). Only whole blocks before the end of the prompt may be pulled.
    stored = list(range(603))
    prefix = HashedTokens(stored, 256).prefix(603, output_start=404)
    result = plan_reuse(prefix, make_handle(603, 128), 128, HashedTokens(stored[:330], 256))
    assert result.path is Path.PARTIAL
    assert result.reason is Reason.PROMPT_SHORTER
    assert result.reused_tokens == 256
    assert result.handle is not None and result.handle["remote_block_ids"] == [[0, 1]]


def test_reasoning_stripped_turn_is_detected_as_last_output_divergence() -> None:
    # Qwen3 drops <think>...</think> of earlier turns: the next prompt diverges right where D's
    # output began (vLLM #43094).
    prompt1 = list(range(1000, 1404))
    output = [7] * 100 + list(range(5000, 5100))
    stored = prompt1 + output[:-1]
    prefix = HashedTokens(stored, 256).prefix(len(stored), output_start=len(prompt1))
    next_prompt = prompt1 + output[100:] + [9] * 20
    result = plan_reuse(prefix, make_handle(len(stored), 128), 128, HashedTokens(next_prompt, 256))
    assert result.reason is Reason.DIVERGED_IN_LAST_OUTPUT
    assert result.path is Path.PARTIAL and result.reused_tokens == 256


def test_history_edit_is_detected_as_history_divergence() -> None:
    stored = list(range(600))
    prefix = HashedTokens(stored, 256).prefix(600, output_start=500)
    edited = [*stored[:300], 99999, *stored[301:], 1, 2, 3]
    result = plan_reuse(prefix, make_handle(600, 16), 16, HashedTokens(edited, 256))
    assert result.reason is Reason.DIVERGED_IN_HISTORY
    assert result.path is Path.PARTIAL and result.reused_tokens == 256


def test_partial_reuse_can_be_turned_off() -> None:
    stored = list(range(600))
    prefix = HashedTokens(stored, 256).prefix(600, output_start=500)
    result = plan_reuse(
        prefix,
        make_handle(600, 16),
        16,
        HashedTokens([*stored[:550], -0 + 1], 256),
        PlanSettings(partial_reuse=False),
    )
    assert result.path is Path.RELEASE
    assert result.handle is not None and result.handle["remote_num_tokens"] == 0


def test_divergence_in_tail_is_reused_to_the_block_before_it() -> None:
    stored = list(range(600))  # chunk 256: 2 whole chunks, tail 512..599
    prefix = HashedTokens(stored, 256).prefix(600, output_start=590)
    prompt = [*stored[:545], -5 + 10**6, 1]
    result = plan_reuse(prefix, make_handle(600, 16), 16, HashedTokens(prompt, 256))
    assert result.path is Path.PARTIAL and result.reused_tokens == 544


def test_block_size_from_handle_geometry() -> None:
    # docs/vllm-protocol.md §1, §7: the CPU build reported R=603 with 5 blocks (block size 128).
    assert block_size_of(make_handle(603, 128)) == 128
    assert block_size_of(make_handle(1871, 16)) == 16
    # A configured size is used when the geometry allows it.
    assert block_size_of(make_handle(10, 16), configured=32) == 32
    assert block_size_of(make_handle(10, 16), configured=4) == 16


def test_truncate_and_release_do_not_touch_the_original() -> None:
    handle = make_handle(603, 128, groups=2)
    cut = truncate_handle(handle, 512, 128)
    assert cut["remote_num_tokens"] == 512
    assert cut["remote_block_ids"] == [[0, 1, 2, 3], [100, 101, 102, 103]]
    assert handle["remote_num_tokens"] == 603 and len(handle["remote_block_ids"][0]) == 5
    released = release_handle(handle)
    assert released["remote_num_tokens"] == 0 and handle["remote_num_tokens"] == 603
    # Every other field travels verbatim (remote_host is never rewritten).
    assert {k: v for k, v in cut.items() if k not in ("remote_num_tokens", "remote_block_ids")} == {
        k: v for k, v in handle.items() if k not in ("remote_num_tokens", "remote_block_ids")
    }


def test_bad_handles_are_never_attached() -> None:
    prefix = HashedTokens([1, 2, 3], 4).prefix(3, output_start=2)
    for bad in (
        {},
        {"remote_num_tokens": "3", "remote_block_ids": [[1]]},
        {"remote_num_tokens": 3, "remote_block_ids": "x"},
    ):
        assert plan_reuse(prefix, bad, 4, HashedTokens([1, 2, 3, 4], 4)).handle is None
    mismatched = make_handle(5, 4)  # stored tokens describe 3, handle says 5
    result = plan_reuse(prefix, mismatched, 4, HashedTokens([1, 2, 3, 4, 5, 6], 4))
    assert result.reason is Reason.BAD_HANDLE and result.path is Path.RELEASE


def test_empty_and_one_token_prompts() -> None:
    prefix = HashedTokens(list(range(200)), 16).prefix(200, output_start=150)
    handle = make_handle(200, 16)
    assert plan_reuse(prefix, handle, 16, HashedTokens([], 16)).path is Path.RELEASE
    assert plan_reuse(prefix, handle, 16, HashedTokens([0], 16)).path is Path.RELEASE


def test_prefix_roundtrips_through_msgpack() -> None:
    import msgspec

    prefix = HashedTokens(list(range(700)), 256).prefix(650, output_start=600)
    again = msgspec.msgpack.decode(msgspec.msgpack.encode(prefix), type=TokenPrefix)
    assert again == prefix
    assert again.tail_tokens() == list(range(512, 650))


def test_handle_with_kv_groups_of_different_lengths_is_used_whole_or_released() -> None:
    # A hybrid model: a full-attention group of 38 blocks and a sliding-window group that
    # kept only its last 4. Cutting both to the same count would send the wrong window.
    stored = list(range(600))
    prefix = HashedTokens(stored, 256).prefix(600, output_start=500)
    handle = make_handle(600, 16)
    handle["remote_block_ids"] = [handle["remote_block_ids"][0], [900, 901, 902, 903]]
    edited = [*stored[:300], 99999, *stored[301:], 1, 2, 3]
    result = plan_reuse(prefix, handle, 16, HashedTokens(edited, 256))
    assert (result.path, result.reason) == (Path.RELEASE, Reason.UNCUTTABLE_HANDLE)
    assert result.handle is not None and result.handle["remote_num_tokens"] == 0
    whole = plan_reuse(prefix, handle, 16, HashedTokens([*stored, 1, 2], 256))
    assert whole.path is Path.REUSE and whole.handle == handle
    # Groups of equal length (two full-attention groups) are cut as before.
    same = make_handle(600, 16, groups=2)
    cut = plan_reuse(prefix, same, 16, HashedTokens(edited, 256))
    assert cut.path is Path.PARTIAL and cut.handle is not None
    assert [len(g) for g in cut.handle["remote_block_ids"]] == [16, 16]
