"""Closed vocabularies of a turn's outcomes, shared by metrics, logs and tests."""

from __future__ import annotations

from enum import StrEnum

__all__ = ["LeftToExpire", "NoHandleCause", "ReleaseCause", "RetryCause"]


class NoHandleCause(StrEnum):
    """Why a finished turn left no handle at D."""

    STREAMED_BEFORE_033 = "streamed_before_0.33"  #: vLLM 0.32 streams return none
    STOP_STRING = "stop_string"  #: vLLM aborts on a stop string: no handle, blocks freed
    #: vLLM's streamed /inference/v1/generate never returns D's params (0.32 and 0.33),
    #: and no capture was tried (``tokens.capture_streamed_handles`` off)
    STREAMED_GENERATE = "streamed_generate"
    #: the one-token request that takes a streamed generate's handle failed
    CAPTURE_FAILED = "capture_failed"
    NONE_RETURNED = "none_returned"


class RetryCause(StrEnum):
    """Why part of a turn ran again."""

    PREFILL_HANDLE_REJECTED = "prefill_handle_rejected"
    PREFILL_FAILED = "prefill_failed"
    DECODE_FAILED = "decode_failed"
    RENDER_FAILED = "render_failed"


class ReleaseCause(StrEnum):
    """Why a handle D returned at the end of a turn was released instead of stored."""

    NO_CONVERSATION = "no_conversation"
    NO_PROMPT_IDS = "no_prompt_ids"
    BAD_HANDLE = "bad_handle"
    SUPERSEDED = "superseded"
    # D ran other prompt ids than the ones checked: its blocks do not hold what we would say.
    DECODE_PROMPT_MISMATCH = "decode_prompt_mismatch"
    # P ran other prompt ids than D was given: D's blocks hold KV of P's ids.
    PREFILL_PROMPT_MISMATCH = "prefill_prompt_mismatch"
    # A commit replaced an older record of the conversation whose handle was never sent.
    REPLACED = "replaced"
    # Its decode instance left its dns:// set (scaled down, replaced): given back while the
    # process may still run, before its TTL would.
    INSTANCE_GONE = "instance_gone"
    # The turn carried fields the router cannot check (router/fields.py): the stored handle
    # is not attached, and it is released.
    REUSE_DISABLED = "reuse_disabled"
    # DELETE ended the conversation while this turn ran.
    CONVERSATION_ENDED = "conversation_ended"
    # D's KV cache ran full of pinned turns: the oldest handles there were given back.
    DECODE_PRESSURE = "decode_pressure"
    # The turn ended on a D at or above decode_kv_pin_limit: its pin was not kept, so the
    # pins do not outgrow what relief gives back.
    DECODE_FULL = "decode_full"
    # The client left before its claimed handle was sent to P.
    CLIENT_GONE = "client_gone"
    # P answered the request that carried the handle with a 4xx: it never ran it.
    PREFILL_REFUSED = "prefill_refused"
    # The prompt had images, audio or embeddings: its ids do not determine its KV, so what D
    # holds is never stored for a later turn.
    IDS_DO_NOT_DETERMINE_KV = "ids_do_not_determine_kv"
    # The turn ran on a D that already held its history (decode-local): the handle is not
    # needed, and D's pin would only hold blocks until its TTL.
    DECODE_LOCAL = "decode_local"
    # D's stream broke after the chunk that carried its handle: the client got an error.
    STREAM_BROKEN = "stream_broken"
    # DELETE of the conversation.
    DELETED = "deleted"
    # The turn ended with an error (no healthy D, a failed capture) before the handle it held
    # was sent or written anywhere: nobody else knows it.
    TURN_FAILED = "turn_failed"


class LeftToExpire(StrEnum):
    """Why a handle was neither surely stored nor released, and so is left for D to free at
    its ``decoder_kv_blocks_ttl``.

    A store call that times out may still run when the store answers again: a commit may land
    (its handle is then stored, and releasing it would let the next turn send a freed handle
    to P: wrong KV), a claim may have taken the record (its handle is then in nobody's hands).
    Only a handle that is provably not stored, and never will be, is released.
    """

    COMMIT_OUTCOME_UNKNOWN = "commit_outcome_unknown"
    CLAIM_OUTCOME_UNKNOWN = "claim_outcome_unknown"
    # The client left while P held the request that carried the handle: P may be reading
    # it, and a release racing that read could leave freed blocks in P's prefix cache.
    SENT_THEN_CANCELLED = "sent_then_cancelled"
    # Its decode instance left its dns:// set unreachable: there is no process to ask.
    INSTANCE_GONE = "instance_gone"
    # No P to carry a release: D served the turn alone.
    NO_PREFILL = "no_prefill"
    # The client left while a decode-local turn ran: the handle kept for release after D's
    # answer is left to D's TTL.
    DECODE_LOCAL_CANCELLED = "decode_local_cancelled"
    # No replica acknowledged the write in time (Redis durability ``replica``): a failover
    # could bring the record back, so the handle it held is neither used nor released.
    NOT_DURABLE = "not_durable"
    # P failed the request that carried the handle (a timeout, a broken connection): it may
    # have read the blocks, so they are not released under it.
    SENT_THEN_FAILED = "sent_then_failed"
    # P answered the handle with a 500: a stale or expired handle it could not read.
    PREFILL_REJECTED = "prefill_rejected"
    # The claimed record had expired: D frees (or has freed) its blocks at its TTL.
    RECORD_EXPIRED = "record_expired"
    # The claimed record's D restarted since it was written: its blocks died with it.
    DECODE_RESTARTED = "decode_restarted"
    # The claimed record's handle could not be read: nothing safe to send.
    UNREADABLE = "unreadable"
    # A stage met an event the fate table has no row for (a bug, also counted as a ledger
    # error): never released, since nothing proves it safe.
    UNPLANNED = "unplanned"
