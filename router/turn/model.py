"""What a turn carries from stage to stage, and the path vocabulary it ends with."""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeAlias

import msgspec

from carryover.router.config import ModelConfig
from carryover.router.fleet.instance import Instance
from carryover.router.fleet.pool import Lease
from carryover.router.handles.ledger import HeldHandle
from carryover.router.metrics import turn_label
from carryover.router.tracing import NO_TRACE, TurnTrace
from carryover.router.turn.path import Entry, PathNote, TurnPath
from carryover.router.turn.placement import KvView, LegChoice
from carryover.router.turn.prefill_answer import RanIds
from carryover.state import ConversationKey, HashedTokens, Path, Plan, Reason, Record

if TYPE_CHECKING:
    from carryover.router.turn.runtime import ModelRuntime

_encoder = msgspec.json.Encoder()

__all__ = [
    "DONE_FRAME",
    "NOTHING_HELD",
    "Leg",
    "PrefillOutcome",
    "Prepared",
    "Relay",
    "Started",
    "TokensPrompt",
    "TurnOutcome",
    "TurnRequest",
]


#: What a turn holds once its handle went, was lost, or never was: nothing to attach.
NOTHING_HELD = Plan(Path.COLD, Reason.NO_RECORD)

#: A request to one engine: its path and JSON body.
Leg: TypeAlias = tuple[str, dict[str, Any]]


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
    body_bytes: int = 0  # the client's body as it came: what rendering it may cost at most
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
    def release_target(self) -> tuple[ModelRuntime, str]:
        """What a handle this turn holds is released through: its model and served name."""
        return self.runtime, self.model_name

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
class Prepared:
    """Prepare's outcome: the checked prompt, the claimed record and its plan, the path the
    turn enters with. Nothing changes it; what the attempts did is in their outcomes."""

    ids: list[int] | None
    hashed: HashedTokens | None
    record: Record | None
    entry: Entry  # what to send P with the claimed handle (its plan), before any attempt
    kv: KvView  # the index's holdings of the prompt, looked up once a turn
    # False when the prompt's ids do not determine its KV (images, audio, embeddings): what D
    # holds at the end is then never stored for a later turn.
    storable: bool = True
    tokens: TokensPrompt | None = None  # tokens-only models only
    claimed: HeldHandle | None = None  # the claimed record's handle in the ledger

    @functools.cached_property
    def ids_json(self) -> bytes:
        """The checked ids as JSON, encoded once a turn: both legs' bodies embed them and P's
        answer is compared with them (20k-token prompts: a third of a turn's encoding)."""
        return _encoder.encode(self.ids)

    @property
    def plan(self) -> Plan:
        return self.entry.plan

    @property
    def ids_raw(self) -> msgspec.Raw | None:
        """The checked ids for a request body (``None``: unchecked)."""
        return None if self.ids is None else msgspec.Raw(self.ids_json)


@dataclass(frozen=True)
class PrefillOutcome:
    """The P leg's outcome: the P that answered (``None``: none could, D runs alone), its
    dict for D and the ids it said it ran; what the turn still holds for a later attempt
    (``plan``: cold once the handle went); what changed the turn's path, in order."""

    instance: Instance | None
    params: dict[str, Any] | None
    ran: RanIds | None
    plan: Plan
    notes: tuple[PathNote, ...]
    choice: LegChoice | None = None


@dataclass(frozen=True)
class Started:
    """An attempt that got D's answer (``answer``) or its first chunk (``events`` after
    ``first``): where it ran, what P ran, and the notes of every attempt of the turn.
    ``held`` owns the lease on D and the connection, whatever ends the turn."""

    decode: Instance
    prefill: Instance | None
    lease: Lease
    held: contextlib.AsyncExitStack
    notes: tuple[PathNote, ...]
    placed: dict[str, LegChoice]  # by leg: its last choice
    prefill_ran: RanIds | None = None  # the prompt ids P said it ran, when it says
    answer: Any = None
    first: bytes | None = None
    events: AsyncIterator[bytes] | None = None


#: A stream's last frame, always.
DONE_FRAME = b"data: [DONE]\n\n"


@dataclass(frozen=True, slots=True)
class Relay:
    """A started stream: its first chunk, then the rest (read directly: one layer less per
    event). Closing ``rest`` ends the turn's stream (its lease, connection and span) even
    when it was never read."""

    first: bytes
    rest: AsyncGenerator[bytes, None]


@dataclass(frozen=True)
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
