"""What a turn carries from stage to stage, and the path vocabulary it ends with."""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass, field
from enum import StrEnum
from typing import TYPE_CHECKING, Any, TypeAlias

import msgspec

from carryover.router.config import ModelConfig
from carryover.router.fleet.instance import Instance
from carryover.router.fleet.pool import Lease
from carryover.router.handles.ledger import HeldHandle
from carryover.router.kv.index import Cached, Prompt
from carryover.router.metrics import turn_label
from carryover.router.tracing import NO_TRACE, TurnTrace
from carryover.router.turn.prefill_answer import RanIds
from carryover.state import ConversationKey, HashedTokens, Path, Plan, Reason, Record

if TYPE_CHECKING:
    from carryover.router.turn.runtime import ModelRuntime

_encoder = msgspec.json.Encoder()

__all__ = [
    "DONE_FRAME",
    "Leg",
    "Prepared",
    "Relay",
    "Started",
    "TokensPrompt",
    "TurnOutcome",
    "TurnPath",
    "TurnRequest",
    "path_of",
]


#: A request to one engine: its path and JSON body.
Leg: TypeAlias = tuple[str, dict[str, Any]]


class TurnPath(StrEnum):
    """How a turn ran (``X-Carryover-Path``, the ``path`` label of metrics, logs)."""

    REUSE = "reuse"  #: the whole stored handle
    PARTIAL = "partial"  #: the handle cut to the blocks before a divergence
    COLD_MISS = "cold-miss"  #: no record
    #: no conversation id: nothing to keep or reuse (a turn of nothing)
    NO_CONVERSATION = "no-conversation"
    COLD_MISMATCH = "cold-mismatch"  #: nothing reusable: the handle was released
    COLD_EXPIRED = "cold-expired"  #: the record's decode instance restarted, or it expired
    COLD_ERROR = "cold-error"  #: store or render down, or P refused the handle
    COLD_UNCHECKED = "cold-unchecked"  #: fields the engine applies itself: nothing checked
    DECODE_LOCAL = "decode-local"  #: D held the prefix and the rest was short: no P leg
    #: no handle, and P loads the start of the prompt from the model's warm tier (LMCache)
    WARM = "warm"
    #: P's own cache held all but a few of the handle's tokens: handle given back, P computed
    PREFILL_CACHE = "prefill-cache"


def path_of(plan_: Plan) -> TurnPath:
    if plan_.path is Path.REUSE:
        return TurnPath.REUSE
    if plan_.path is Path.PARTIAL:
        return TurnPath.PARTIAL
    if plan_.path is Path.RELEASE or plan_.reason is Reason.BAD_HANDLE:
        return TurnPath.COLD_MISMATCH
    if plan_.reason in (Reason.EXPIRED, Reason.STALE_ENGINE):
        return TurnPath.COLD_EXPIRED
    return TurnPath.COLD_MISS


@dataclass
class TurnRequest:
    runtime: ModelRuntime  # the served model: its config, renderer, engine API, checks
    model_name: str  # what the engines are asked for
    key: ConversationKey | None
    body: dict[str, Any]  # the client's body, conversation id removed
    chat: bool
    stream: bool
    client_wants_ids: bool
    request_id: str
    turn: int | None  # chat: the number of user messages; completions: from the record
    tenant: str = "default"
    model_name_known: bool = True  # False: the engines' served name is not known yet
    started: float = field(default_factory=time.monotonic)
    trace: TurnTrace = NO_TRACE

    @property
    def model(self) -> ModelConfig:
        return self.runtime.config

    @property
    def reuses(self) -> bool:
        """The turn may claim and store its conversation's record: it has a conversation,
        its model keeps records, and the model's served name is known. Until the engines
        have said their served name, the client's name could be any adapter's, and a record
        under it could hold another model's KV: such turns run without reuse."""
        return self.key is not None and self.model.reuse and self.model_name_known

    @property
    def running_for(self) -> float:
        """Seconds since the turn started: the store fences DELETE races with it on its own
        clock (a duration, unlike a wall-clock time, means the same on every replica)."""
        return time.monotonic() - self.started

    @property
    def model_label(self) -> str:
        """The model as metrics name it: the served name once known, never a client's guess
        (a label per name a client sends would grow without bound)."""
        return self.model_name if self.model_name_known else ""

    @property
    def cache_salt(self) -> str | None:
        """The salt every engine request of the turn carries (router/tenants/salt.py)."""
        salt: str | None = self.body.get("cache_salt")
        return salt

    @property
    def engine_headers(self) -> dict[str, str]:
        return {"X-Request-Id": self.request_id, **self.trace.headers()}

    @property
    def path(self) -> str:
        return "/v1/chat/completions" if self.chat else "/v1/completions"

    @property
    def turn_label(self) -> str:
        return turn_label(self.turn, self.key is not None)


@dataclass(frozen=True)
class TokensPrompt:
    """A tokens-only model's rendered request: the render server's ``GenerateRequest``, and
    the client's request as the render server saw it (its derender wants it back)."""

    generate: dict[str, Any]
    request: dict[str, Any]

    @property
    def ids(self) -> list[int]:
        ids: list[int] = self.generate["token_ids"]
        return ids


@dataclass(frozen=True)
class LegChoice:
    """The instance a leg chose, and what the KV-event index said of it (the turn's log
    line): the prompt's leading tokens it held, and the most any candidate held (``None``:
    no index, unchecked ids, or candidates not given)."""

    instance: str
    indexed: int | None = None
    most_indexed: int | None = None


@dataclass
class Prepared:
    """The checked prompt and what to do with the conversation's stored handle."""

    ids: list[int] | None
    hashed: HashedTokens | None
    record: Record | None
    plan: Plan
    path: TurnPath
    # False when the prompt's ids do not determine its KV (images, audio, embeddings): what D
    # holds at the end is then never stored for a later turn.
    storable: bool = True
    kv_prompt: Prompt | None = None  # the ids' chain keys for the KV index, made on first use
    cache_salt: str | None = None  # the turn's salt: the index's chains start from it
    kv_cached: dict[str, Cached | None] = field(default_factory=dict)  # by instance, per turn
    warm_cached: dict[str, int] = field(default_factory=dict)  # tokens held, by warm tier
    tokens: TokensPrompt | None = None  # tokens-only models only
    planned_reuse: int = 0  # prompt tokens the plan's handle covers, if it is used
    claimed: HeldHandle | None = (
        None  # the claimed record's handle in the ledger (router/handles/ledger.py)
    )
    prefill_ids: RanIds | None = None  # the prompt ids P said it ran, when it says
    placed: dict[str, LegChoice] = field(default_factory=dict)  # by leg: its last choice
    _ids_json: bytes | None = None

    @property
    def ids_json(self) -> bytes:
        """The checked ids as JSON, encoded once a turn: both legs' bodies embed them and P's
        answer is compared with them (20k-token prompts: a third of a turn's encoding)."""
        if self._ids_json is None:
            self._ids_json = _encoder.encode(self.ids)
        return self._ids_json

    @property
    def ids_raw(self) -> msgspec.Raw | None:
        """The checked ids for a request body (``None``: unchecked)."""
        return None if self.ids is None else msgspec.Raw(self.ids_json)

    @property
    def reused_tokens(self) -> int:
        """Prompt tokens P got from D's handle: the plan's, on the paths that used it."""
        return self.planned_reuse if self.path in (TurnPath.REUSE, TurnPath.PARTIAL) else 0

    def spend_handle(self, path: TurnPath = TurnPath.COLD_ERROR) -> None:
        """The claimed handle was used or lost: later attempts run cold."""
        self.plan = Plan(Path.COLD, Reason.NO_RECORD)
        self.path = path

    def unsend(self, plan: Plan, path: TurnPath) -> None:
        """The request that carried the handle never left (no connection): it is still ours."""
        self.plan = plan
        self.path = path


@dataclass
class Started:
    """D has answered (``answer``) or begun streaming (``events`` after ``first``). ``held``
    owns the lease on D and the connection, whatever ends the turn."""

    decode: Instance
    prefill: Instance | None
    lease: Lease
    held: contextlib.AsyncExitStack
    answer: Any = None
    first: bytes | None = None
    events: AsyncIterator[bytes] | None = None


#: A stream's last frame, always.
DONE_FRAME = b"data: [DONE]\n\n"


@dataclass(frozen=True, slots=True)
class Relay:
    """A started stream: its first chunk, then the rest (read directly: one layer less per
    event). ``aclose`` ends the turn's stream (its lease, connection and span) even when
    ``rest`` was never read."""

    first: bytes
    rest: AsyncGenerator[bytes, None]

    async def aclose(self) -> None:
        await self.rest.aclose()


@dataclass
class TurnOutcome:
    """What happened, decided once when the answer (or its first chunk) is ready: the
    metrics, the log line, the span and ``X-Carryover-Path`` all read this."""

    path: TurnPath
    body: bytes | None = None
    chunks: Relay | None = None
    prompt_tokens: int | None = None  # None: the engines rendered it (nothing checked)
    reused_tokens: int = 0  # pulled from D with the handle
    handle: str = "none"  # the claimed handle's fate so far ("sent", "released:superseded", …)
    placed: dict[str, LegChoice] = field(default_factory=dict)  # by leg

    @classmethod
    def of(cls, prepared: Prepared, **answer: Any) -> TurnOutcome:
        claimed = prepared.claimed
        if claimed is None:
            handle = "none"
        elif claimed.fate is None:
            handle = "held"
        else:
            handle = f"{claimed.fate}:{claimed.cause}" if claimed.cause else str(claimed.fate)
        return cls(
            prepared.path,
            prompt_tokens=len(prepared.ids) if prepared.ids is not None else None,
            reused_tokens=prepared.reused_tokens,
            handle=handle,
            placed=prepared.placed,
            **answer,
        )
