"""Every held handle's fate, decided in one table (docs/handles.md shows it).

A fate depends on two things only: how far the handle got (:class:`Stage`) and what the
turn, the engine, the store or the client then did (:class:`Event`). :func:`decide` maps the
pair to exactly one :class:`Decision`: stored, sent, released (D frees its blocks now) or
left to expire (D's ``decoder_kv_blocks_ttl`` frees them); or *not yet*, where the turn
carries the handle further (a move to the next stage) or another party already owns the
outcome (a store write in flight decides for a handle it carries). The ledger
(``router/handles/ledger.py``) is the one place that carries a decision out.

The rule behind the table: release only what is provably not stored and never read by P;
leave to expire whatever P may be reading or a store may still hold. A pair missing from the
table is a bug; it is counted and the handle is left to expire, never released.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Final

from carryover.router.outcomes import LeftToExpire, ReleaseCause

__all__ = ["FATES", "Decision", "Event", "Fate", "Stage", "decide"]


class Fate(StrEnum):
    """Where a held handle ended."""

    SENT = "sent"  #: to P with the turn that reused it
    STORED = "stored"  #: in the store, for the conversation's next turn
    RELEASED = "released"  #: given back to D now (cause: ``ReleaseCause``)
    LEFT_TO_EXPIRE = "left_to_expire"  #: for D's TTL to free (cause: ``LeftToExpire``)


class Stage(StrEnum):
    """How far a held handle got."""

    CLAIMED = "claimed"  #: this turn took it from the store; nothing has carried it anywhere
    SENT = "sent"  #: in a request to P that may have reached P
    #: kept as D's pin while D serves the turn from its own prefix cache (decode-local)
    DECODE_LOCAL = "decode_local"
    DECODED = "decoded"  #: D returned it at the end of this turn; not written anywhere
    WRITING = "writing"  #: in a store write (commit, put-back) that has not answered
    TAKEN = "taken"  #: taken from the store outside a turn (replaced, relief, DELETE)
    #: a store call that failed or was not durable may have taken it: it is in no one's hands
    UNKNOWN = "unknown"


class Event(StrEnum):
    """What happened to a held handle (``detail``: the cause the caller knows, where the
    table says the cause is the caller's)."""

    # The turn carries it further (no fate yet).
    SENDING = "sending"  #: a request to P is about to carry it
    NEVER_LEFT = "never_left"  #: that request found no connection: it never left
    WRITING = "writing"  #: a store write (the commit, a put-back) carries it
    DECODE_LOCAL = "decode_local"  #: D serves the turn alone; its pin keeps the history
    # The plan, on a claimed record.
    RECORD_EXPIRED = "record_expired"
    DECODE_RESTARTED = "decode_restarted"
    UNREADABLE = "unreadable"
    UNCHECKED = "unchecked"  #: the turn cannot be checked: the handle is never attached
    # P.
    P_READ = "p_read"  #: P answered the request that carried it
    P_FREED = "p_freed"  #: it went with ``remote_num_tokens`` 0 and P answered (detail: why)
    P_REFUSED = "p_refused"  #: P's own 4xx that proves it never ran the request
    #: an answer that does not prove P never read it (408, 429: a proxy in front of P)
    P_UNPROVEN = "p_unproven"
    P_REJECTED = "p_rejected"  #: P's fast 500: a stale or expired handle it could not read
    P_FAILED = "p_failed"  #: a timeout or broken connection after the request was sent
    NO_PREFILL = "no_prefill"  #: no P can serve: D runs alone
    # D.
    D_DONE = "d_done"  #: decode-local: D answered or failed; its pin is not needed
    NOT_STORABLE = "not_storable"  #: D's handle cannot describe the next turn (detail: why)
    STREAM_BROKEN = "stream_broken"  #: D's stream broke after the chunk with its handle
    # The store.
    WRITTEN = "written"
    SUPERSEDED = "superseded"  #: a later turn is stored
    ENDED = "ended"  #: DELETE ended the conversation while the turn ran
    STORE_UNKNOWN = "store_unknown"  #: the call failed or timed out: it may still land
    NOT_DURABLE = "not_durable"  #: no replica acknowledged it: a failover may bring it back
    # The client, and the turn as a whole.
    CLIENT_GONE = "client_gone"
    TURN_FAILED = "turn_failed"  #: the turn ended with an error the stages did not settle
    # Outside a turn.
    GIVEN_BACK = "given_back"  #: DELETE, pressure relief, a departed D (detail: which)
    INSTANCE_UNREACHABLE = "instance_unreachable"  #: its D left unreachable: none to ask


@dataclass(frozen=True, slots=True)
class Decision:
    """A fate and its cause; ``cause`` ``None``: the caller's ``detail``. ``fate`` ``None``:
    not yet, the handle moves on to ``stage`` or, with none, the party that owns the outcome
    decides. ``carried``: a release that the turn's own P request already carried
    (``remote_num_tokens`` 0): nothing more to send."""

    fate: Fate | None
    cause: str | None = ""
    carried: bool = False
    stage: Stage | None = None


_NOT_YET: Final = Decision(None)
_SENT: Final = Decision(Fate.SENT)
_STORED: Final = Decision(Fate.STORED)


def _moves(stage: Stage) -> Decision:
    return Decision(None, stage=stage)


def _released(cause: ReleaseCause | None) -> Decision:
    return Decision(Fate.RELEASED, cause)


def _left(cause: LeftToExpire) -> Decision:
    return Decision(Fate.LEFT_TO_EXPIRE, cause)


_E, _S = Event, Stage

#: Every fate a handle can meet: (how far it got, what happened) -> what becomes of it.
FATES: Final[dict[tuple[Stage, Event], Decision]] = {
    # Carried further: the only moves a handle makes before its fate.
    (_S.CLAIMED, _E.SENDING): _moves(Stage.SENT),
    (_S.SENT, _E.NEVER_LEFT): _moves(Stage.CLAIMED),
    (_S.CLAIMED, _E.WRITING): _moves(Stage.WRITING),  # put back
    (_S.CLAIMED, _E.DECODE_LOCAL): _moves(Stage.DECODE_LOCAL),
    (_S.DECODED, _E.WRITING): _moves(Stage.WRITING),  # committed
    # Claimed, not sent: nobody but this turn can send it, so it is released, except where
    # its blocks are gone or no P can carry a release.
    (_S.CLAIMED, _E.RECORD_EXPIRED): _left(LeftToExpire.RECORD_EXPIRED),
    (_S.CLAIMED, _E.DECODE_RESTARTED): _left(LeftToExpire.DECODE_RESTARTED),
    (_S.CLAIMED, _E.UNREADABLE): _left(LeftToExpire.UNREADABLE),
    (_S.CLAIMED, _E.UNCHECKED): _released(ReleaseCause.REUSE_DISABLED),
    (_S.CLAIMED, _E.NO_PREFILL): _left(LeftToExpire.NO_PREFILL),
    (_S.CLAIMED, _E.CLIENT_GONE): _released(ReleaseCause.CLIENT_GONE),
    (_S.CLAIMED, _E.TURN_FAILED): _released(ReleaseCause.TURN_FAILED),
    # Sent: P may be reading it. Released only where P's answer proves it never ran.
    (_S.SENT, _E.P_READ): _SENT,
    (_S.SENT, _E.P_FREED): Decision(Fate.RELEASED, None, carried=True),
    (_S.SENT, _E.P_REFUSED): _released(ReleaseCause.PREFILL_REFUSED),
    (_S.SENT, _E.P_UNPROVEN): _left(LeftToExpire.SENT_THEN_FAILED),
    (_S.SENT, _E.P_REJECTED): _left(LeftToExpire.PREFILL_REJECTED),
    (_S.SENT, _E.P_FAILED): _left(LeftToExpire.SENT_THEN_FAILED),
    (_S.SENT, _E.CLIENT_GONE): _left(LeftToExpire.SENT_THEN_CANCELLED),
    (_S.SENT, _E.TURN_FAILED): _left(LeftToExpire.SENT_THEN_FAILED),
    # D's pin under a decode-local turn: given back once D is done with it.
    (_S.DECODE_LOCAL, _E.D_DONE): _released(ReleaseCause.DECODE_LOCAL),
    (_S.DECODE_LOCAL, _E.CLIENT_GONE): _left(LeftToExpire.DECODE_LOCAL_CANCELLED),
    (_S.DECODE_LOCAL, _E.TURN_FAILED): _released(ReleaseCause.DECODE_LOCAL),
    # D's new handle before any write: nobody else knows it.
    (_S.DECODED, _E.NOT_STORABLE): _released(None),
    (_S.DECODED, _E.STREAM_BROKEN): _released(ReleaseCause.STREAM_BROKEN),
    (_S.DECODED, _E.CLIENT_GONE): _released(ReleaseCause.CLIENT_GONE),
    (_S.DECODED, _E.TURN_FAILED): _released(ReleaseCause.TURN_FAILED),
    # In a store write: the write's answer decides, whatever the client does meanwhile.
    (_S.WRITING, _E.WRITTEN): _STORED,
    (_S.WRITING, _E.SUPERSEDED): _released(ReleaseCause.SUPERSEDED),
    (_S.WRITING, _E.ENDED): _released(ReleaseCause.CONVERSATION_ENDED),
    (_S.WRITING, _E.STORE_UNKNOWN): _left(LeftToExpire.COMMIT_OUTCOME_UNKNOWN),
    (_S.WRITING, _E.CLIENT_GONE): _NOT_YET,
    (_S.WRITING, _E.TURN_FAILED): _NOT_YET,
    # Taken outside a turn.
    (_S.TAKEN, _E.GIVEN_BACK): _released(None),
    (_S.TAKEN, _E.INSTANCE_UNREACHABLE): _left(LeftToExpire.INSTANCE_GONE),
    (_S.TAKEN, _E.NOT_DURABLE): _left(LeftToExpire.NOT_DURABLE),
    # Perhaps taken by a store call whose outcome is unknown.
    (_S.UNKNOWN, _E.NOT_DURABLE): _left(LeftToExpire.NOT_DURABLE),
    (_S.UNKNOWN, _E.STORE_UNKNOWN): _left(LeftToExpire.CLAIM_OUTCOME_UNKNOWN),
}

#: What a pair the table lacks comes to: never a release (a bug is counted as well).
UNPLANNED: Final = _left(LeftToExpire.UNPLANNED)


def decide(stage: Stage, event: Event, detail: str | None = None) -> tuple[Decision, bool]:
    """The decision for ``event`` at ``stage``, with the caller's ``detail`` as the cause
    where the table leaves it to the caller; ``False`` with it when the pair is not in the
    table (the handle is left to expire)."""
    decision = FATES.get((stage, event))
    if decision is None:
        return UNPLANNED, False
    if decision.cause is None:
        return Decision(decision.fate, detail or str(event), decision.carried), True
    return decision, True


def table() -> str:
    """The fate table as docs/handles.md shows it (a test keeps the two equal)."""
    lines = ["| how far the handle got | what happened | fate | cause |", "|---|---|---|---|"]
    for (stage, event), decision in FATES.items():
        if decision.stage is not None:
            fate = f"none yet: moves to `{decision.stage}`"
        elif decision.fate is None:
            fate = "not yet: the write decides"
        else:
            fate = str(decision.fate)
        cause = (
            "the caller's"
            if decision.cause is None
            else f"`{decision.cause}`"
            if decision.cause
            else ""
        )
        if decision.carried:
            cause += " (carried by the turn's own P request)"
        lines.append(f"| `{stage}` | `{event}` | {fate} | {cause} |")
    return "\n".join(lines)
