from __future__ import annotations

import time

from carryover.state import HashedTokens, Path, Reason, plan
from tests.support.records import make_record


def test_no_record_is_cold() -> None:
    result = plan(None, [1, 2, 3], now=time.time(), decode_epoch=0)
    assert (result.path, result.reason, result.handle) == (Path.COLD, Reason.NO_RECORD, None)


def test_expired_record_is_cold_and_its_handle_is_not_sent() -> None:
    record = make_record(1, ttl=10)
    ids = list(range(101)) + [5, 6]
    assert plan(record, ids, now=record.created_at, decode_epoch=0).path is Path.REUSE
    late = plan(record, ids, now=record.expires_at, decode_epoch=0)
    assert (late.path, late.reason, late.handle) == (Path.COLD, Reason.EXPIRED, None)


def test_record_from_before_a_decode_restart_is_stale() -> None:
    record = make_record(1, epoch=3)
    ids = list(range(101)) + [5]
    assert plan(record, ids, now=time.time(), decode_epoch=4).reason is Reason.STALE_ENGINE
    assert plan(record, ids, now=time.time(), decode_epoch=None).reason is Reason.STALE_ENGINE
    assert plan(record, ids, now=time.time(), decode_epoch=3).path is Path.REUSE
    # Written by a replica that saw the restart before this one did: not stale.
    assert plan(record, ids, now=time.time(), decode_epoch=2).path is Path.REUSE


def test_prompt_hashed_with_another_chunk_size_is_rehashed() -> None:
    record = make_record(1)
    ids = list(range(101)) + [5]
    result = plan(record, HashedTokens(ids, 16), now=time.time(), decode_epoch=0)
    assert result.path is Path.REUSE and result.reused_tokens == 101
