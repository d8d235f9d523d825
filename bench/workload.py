"""Multi-turn workloads: generated (seeded) or read from vLLM's and ShareGPT's formats."""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec

__all__ = [
    "Conversation",
    "Distribution",
    "WorkloadSpec",
    "filler",
    "generate",
    "read_conversations",
]

_WORDS = [
    "river",
    "stone",
    "garden",
    "season",
    "winter",
    "summer",
    "leaf",
    "root",
    "water",
    "light",
    "shadow",
    "path",
    "wall",
    "gate",
    "bench",
    "moss",
    "fern",
    "oak",
    "pine",
    "willow",
    "rain",
    "frost",
    "soil",
    "seed",
    "bloom",
    "branch",
    "bird",
    "nest",
    "pond",
    "bridge",
    "hill",
    "morning",
    "evening",
    "window",
    "door",
    "lamp",
    "table",
    "chair",
    "book",
    "letter",
    "story",
    "question",
    "answer",
    "reason",
]


class Distribution(msgspec.Struct, frozen=True):
    """``constant`` (value), ``uniform`` (low..high) or ``lognormal`` (median, sigma; at most
    ``high`` when it is set)."""

    kind: str = "constant"
    value: float = 100
    low: float = 0
    high: float = 0
    sigma: float = 0.5

    def sample(self, rng: random.Random, minimum: int = 1) -> int:
        if self.kind == "constant":
            value = self.value
        elif self.kind == "uniform":
            value = rng.uniform(self.low, self.high)
        elif self.kind == "lognormal":
            value = rng.lognormvariate(math.log(self.value), self.sigma)
            if self.high > 0:
                value = min(value, self.high)
        else:
            raise ValueError(f"unknown distribution {self.kind!r}")
        return max(minimum, int(value))

    @classmethod
    def parse(cls, text: str) -> Distribution:
        """``500`` | ``uniform:100:900`` | ``lognormal:400:0.6``."""
        parts = text.split(":")
        if len(parts) == 1:
            return cls("constant", float(parts[0]))
        if parts[0] == "uniform" and len(parts) == 3:
            return cls("uniform", low=float(parts[1]), high=float(parts[2]))
        if parts[0] == "lognormal" and len(parts) == 3:
            return cls("lognormal", float(parts[1]), sigma=float(parts[2]))
        raise ValueError(f"cannot parse distribution {text!r}")


class WorkloadSpec(msgspec.Struct, frozen=True):
    conversations: int = 16
    turns: int = 5
    max_turns: int = 0  # above ``turns``: each conversation has turns..max_turns, uniformly
    system_tokens: Distribution = Distribution("constant", 200)
    user_tokens: Distribution = Distribution("constant", 500)
    output_tokens: Distribution = Distribution("constant", 200)
    think_time: Distribution = Distribution("constant", 0)  # milliseconds
    reasoning_share: float = 0.0
    edit_probability: float = 0.0
    arrival: str = "closed"  # "closed": all start at once; "poisson": ``rate`` new per second
    rate: float = 4.0
    seed: int = 0
    # Every conversation opens with the same system prompt (a tool list, say), as many
    # conversations of one application do.
    shared_system: bool = False
    # Agent loops: every message after the first is a tool's result (role "tool"), and turns
    # are answered whole (not streamed).
    tool_results: bool = False
    stream: bool = True


@dataclass
class Conversation:
    id: str
    system: str | None
    users: list[str]
    output_tokens: list[int]
    think_ms: list[int]
    thinking: bool = False
    edits: dict[int, int] = field(default_factory=dict)  # turn -> earlier user message to rewrite
    start_after: float = 0.0
    tool_results: bool = False  # messages after the first are tools' results (role "tool")
    stream: bool = True


def filler(rng: random.Random, tokens: int) -> str:
    """About ``tokens`` tokens of words (the generated workloads' text)."""
    # About one token per word (a space-led lowercase word is one token in Qwen's vocabulary).
    return " ".join(rng.choice(_WORDS) for _ in range(tokens))


def generate(spec: WorkloadSpec) -> list[Conversation]:
    rng = random.Random(spec.seed)
    conversations = []
    clock = 0.0
    shared: str | None = None
    if spec.shared_system:  # drawn only then: other workloads stay as their seed made them
        shared_len = spec.system_tokens.sample(rng)
        shared = filler(rng, shared_len) if shared_len > 1 else None
    for index in range(spec.conversations):
        system_len = spec.system_tokens.sample(rng)
        own = filler(rng, system_len) if system_len > 1 else None
        turns = spec.turns
        if spec.max_turns > spec.turns:  # drawn only then: as above
            turns = rng.randint(spec.turns, spec.max_turns)
        conversation = Conversation(
            id=f"conv-{spec.seed}-{index}",
            system=shared if spec.shared_system else own,
            users=[
                f"[{index}.{t}] " + filler(rng, spec.user_tokens.sample(rng)) for t in range(turns)
            ],
            output_tokens=[spec.output_tokens.sample(rng) for _ in range(turns)],
            think_ms=[spec.think_time.sample(rng, minimum=0) for _ in range(turns)],
            thinking=rng.random() < spec.reasoning_share,
            tool_results=spec.tool_results,
            stream=spec.stream,
        )
        for turn in range(1, turns):
            if rng.random() < spec.edit_probability:
                conversation.edits[turn] = rng.randrange(turn)
        if spec.arrival == "poisson":
            clock += rng.expovariate(spec.rate)
            conversation.start_after = clock
        conversations.append(conversation)
    return conversations


def read_conversations(
    path: Path, *, output_tokens: int = 200, limit: int | None = None
) -> list[Conversation]:
    """vLLM's multi-turn benchmark input (``generate_multi_turn.json`` output: a list or dict of
    ``{"messages": [...]}``) or ShareGPT (``{"conversations": [{"from", "value"}]}``). Only the
    user turns are replayed; answers come from the engines."""
    data: Any = json.loads(path.read_text())
    items = list(data.values()) if isinstance(data, dict) else list(data)
    conversations = []
    for index, item in enumerate(items[:limit]):
        turns = item.get("messages") or item.get("conversations") or []
        users = []
        system = None
        for message in turns:
            role = message.get("role") or message.get("from")
            text = message.get("content") if "content" in message else message.get("value")
            if role in ("user", "human"):
                users.append(str(text))
            elif role == "system" and system is None:
                system = str(text)
        if users:
            cid = str(item.get("id") or item.get("conversation_id") or f"file-{index}")
            conversations.append(
                Conversation(cid, system, users, [output_tokens] * len(users), [0] * len(users))
            )
    return conversations
