"""What a simulated engine's requests are made of: the request, its tokens and end, the
sequence the scheduler runs, and a hold on blocks another instance may read."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "EngineError",
    "EngineSequence",
    "Finished",
    "GenerationRequest",
    "Hold",
    "Token",
    "cdiv",
]


class EngineError(Exception):
    def __init__(self, status: int, message: str, kind: str = "BadRequestError") -> None:
        super().__init__(message)
        self.status = status
        self.kind = kind


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass
class GenerationRequest:
    request_id: str  # vLLM's internal id: "<response id>-<8 hex>"
    prompt: list[int]
    max_tokens: int
    ignore_eos: bool = False
    stop: list[str] = field(default_factory=list)
    thinking: bool = False
    kv_params: dict[str, Any] | None = None
    cache_salt: str | None = None  # salts the prefix-cache keys only (vLLM's ``cache_salt``)


@dataclass
class Token:
    token_id: int
    text: str


@dataclass
class Finished:
    reason: str  # "stop" | "length"
    stop_reason: str | int | None
    kv_params: dict[str, Any] | None
    cached_tokens: int


@dataclass(eq=False)
class EngineSequence:
    request: GenerationRequest
    role: str  # "prefill" (P leg), "decode" (D leg / D-node), "plain"
    blocks: list[int] = field(default_factory=list)
    computed: int = 0  # prompt tokens with KV before scheduling (cache hits + loads)
    cached: int = 0  # prompt tokens from the local prefix cache
    external: int = 0  # prompt tokens loaded from another instance
    answer: list[int] = field(default_factory=list)
    output: list[int] = field(default_factory=list)
    text: str = ""
    events: asyncio.Queue[Token | Finished | EngineError] = field(default_factory=asyncio.Queue)
    aborted: bool = False
    finished: bool = False
    preempted: bool = False  # its blocks were taken back: it recomputes before its next step


@dataclass
class Hold:
    blocks: list[int]
    deadline: float  # on this engine's monotonic clock
    pinned: bool  # True: D's pin for a later turn; False: P's lease for D's read
