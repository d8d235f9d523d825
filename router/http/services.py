"""What every route handler reaches: the app's services, and the lookups they share."""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from litestar import Request, Response

from carryover.router.config import ModelConfig, RouterConfig
from carryover.router.engines.upstream import Upstream
from carryover.router.errors import BadConversationId, ModelNotFound
from carryover.router.fleet.pool import InstancePool
from carryover.router.http.auth import Authenticator
from carryover.router.kv.service import KvEvents
from carryover.router.metrics import RouterMetrics
from carryover.router.openai import BodyLimits
from carryover.router.tenants.limits import TenantGate
from carryover.router.tenants.salt import CacheSalts
from carryover.router.tracing import Tracing
from carryover.router.turn import TurnRunner
from carryover.router.turn.runtime import ModelRuntime, Models
from carryover.state import ConversationKey, InvalidIdentifier, Store

__all__ = ["Services", "conversation_key", "json_response", "resolve_model", "services_of"]


@dataclass
class Services:
    config: RouterConfig
    store: Store
    upstream: Upstream
    pool: InstancePool
    runner: TurnRunner
    metrics: RouterMetrics
    auth: Authenticator
    models: Models  # every configured model's runtime (its served name once known)
    tracing: Tracing
    kv: KvEvents
    salts: CacheSalts
    gate: TenantGate
    limits: BodyLimits  # what one request may hold
    clock: Callable[[], float] = time.time
    in_flight: int = 0
    closing: bool = False
    #: Set when a request with a body decoded off the loop ends: the heap is trimmed after it.
    large_ended: asyncio.Event = field(default_factory=asyncio.Event)

    def __post_init__(self) -> None:
        # Read when scraped: a request would otherwise set it twice.
        self.metrics.sampled(self.metrics.in_flight, lambda: self.in_flight)


def json_response(
    status: int, content: bytes, headers: dict[str, str] | None = None
) -> Response[bytes]:
    return Response(content, status_code=status, media_type="application/json", headers=headers)


def services_of(request: Request[Any, Any, Any]) -> Services:
    services: Services = request.app.state.services
    return services


class Resolved(NamedTuple):
    runtime: ModelRuntime
    name: str  # what the engines are asked for
    known: bool  # the served name is known: ``name`` is it, not what the client sent

    @property
    def model(self) -> ModelConfig:
        return self.runtime.config


def resolve_model(services: Services, name: str | None) -> Resolved:
    """The request's model, resolved once: its runtime goes with the turn."""
    models = services.models
    for runtime in models:
        if runtime.name is not None and runtime.name == name:
            return Resolved(runtime, runtime.name, True)
    if len(models) == 1:
        (runtime,) = models
        if runtime.name is None:
            # Not asked of the engines yet: they judge the client's name themselves.
            return Resolved(runtime, name or "", False)
        if name is None:
            return Resolved(runtime, runtime.name, True)
    raise ModelNotFound(f"The model `{name}` does not exist.")


def salt_digest(client_salt: str | None) -> str:
    """A client's ``cache_salt`` as the conversation key holds it: a digest (a salt may hold
    any character vLLM allows, and the key holds no secret a store reader could use)."""
    if client_salt is None:
        return ""
    return hashlib.sha256(client_salt.encode()).hexdigest()[:32]


def conversation_key(
    tenant: str, resolved: Resolved, conversation_id: str, client_salt: str | None = None
) -> ConversationKey:
    if conversation_id.startswith("/") or conversation_id.endswith("/") or "//" in conversation_id:
        # DELETE /v1/conversations/{id} could never name it: URL paths are normalized.
        raise BadConversationId(
            "a conversation id may hold '/' only between other characters, never two in a row"
        )
    try:
        # A model whose name is not known yet (discovery pending) names no namespace: its
        # turns never claim or store (TurnRequest.reuses), whatever name the client sent.
        namespace = resolved.name if resolved.known else "default"
        return ConversationKey(
            tenant, namespace or "default", conversation_id, salt_digest(client_salt)
        )
    except InvalidIdentifier as exc:
        raise BadConversationId(str(exc)) from exc
