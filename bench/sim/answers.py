"""What the simulated model says: a deterministic function of the KV it attends to.

The answer is chosen as *text* (words picked by a generator seeded with the context
fingerprint) and emitted as the ids the tokenizer gives for that text, so a client that sends
the answer back renders to the same ids, as a trained model's answers nearly always do. The
``noncanonical`` switch emits one id per character instead (what a random-weight model does):
the text is the same, the ids are not what re-tokenizing it gives.
"""

from __future__ import annotations

import random

from carryover.bench.sim.chat import SimTemplate

__all__ = ["AnswerPlanner", "split_reasoning"]

_WORDS = [
    "the",
    "of",
    "and",
    "to",
    "in",
    "is",
    "that",
    "it",
    "for",
    "on",
    "was",
    "with",
    "as",
    "be",
    "by",
    "at",
    "this",
    "from",
    "or",
    "have",
    "an",
    "they",
    "which",
    "one",
    "you",
    "were",
    "all",
    "we",
    "can",
    "her",
    "has",
    "there",
    "been",
    "if",
    "more",
    "when",
    "will",
    "would",
    "who",
    "so",
    "no",
    "out",
    "up",
    "into",
    "than",
    "them",
    "time",
    "only",
    "could",
    "new",
    "some",
    "these",
    "two",
    "may",
    "first",
    "then",
    "do",
    "any",
    "like",
    "my",
    "now",
    "over",
    "such",
    "our",
    "man",
    "me",
    "even",
    "most",
    "made",
    "after",
    "also",
    "did",
    "many",
    "before",
    "must",
    "through",
    "back",
    "years",
    "where",
    "much",
    "your",
    "way",
    "well",
    "down",
    "should",
    "because",
    "each",
    "just",
    "those",
    "people",
    "how",
    "too",
    "little",
    "state",
    "good",
    "very",
    "make",
    "world",
    "still",
    "own",
    "see",
    "men",
    "work",
    "long",
    "here",
    "get",
    "both",
    "between",
    "life",
    "being",
    "under",
    "never",
    "day",
    "same",
    "another",
    "know",
    "while",
    "last",
    "might",
    "us",
    "great",
    "old",
    "year",
    "off",
    "come",
    "since",
    "against",
    "go",
    "came",
    "right",
    "used",
    "take",
    "three",
    "small",
    "large",
    "next",
    "early",
    "young",
    "important",
    "few",
    "public",
    "bad",
    "able",
    "order",
    "light",
    "river",
    "stone",
    "garden",
    "window",
    "market",
    "letter",
    "number",
    "answer",
    "question",
    "reason",
    "system",
    "model",
    "cache",
    "token",
    "block",
    "engine",
    "router",
    "turn",
    "prefix",
    "memory",
    "signal",
    "value",
    "vector",
    "matrix",
    "layer",
]


def split_reasoning(text: str) -> tuple[str | None, str]:
    """Split Qwen3-shaped output into (reasoning, content) as vLLM's ``qwen3`` parser does."""
    if "</think>" not in text:
        return None, text
    reasoning, _, content = text.partition("</think>")
    reasoning = reasoning.replace("<think>", "", 1).strip("\n")
    return reasoning, content.lstrip("\n")


class AnswerPlanner:
    def __init__(self, template: SimTemplate, *, noncanonical: bool = False) -> None:
        self._template = template
        self._noncanonical = noncanonical
        self._eos = template.eos_token_id

    def _sentence(self, rng: random.Random, words: int) -> str:
        picked = [rng.choice(_WORDS) for _ in range(words)]
        picked[0] = picked[0].capitalize()
        return " ".join(picked) + "."

    def _encode_answer(self, text: str) -> list[int]:
        if not self._noncanonical:
            return self._template.encode(text)
        ids: list[int] = []
        for char in text:
            ids.extend(self._template.encode(char))
        return ids

    def plan(
        self, fingerprint: bytes, *, max_tokens: int, ignore_eos: bool, thinking: bool
    ) -> list[int]:
        """The full output ids for a context (EOS included when the answer ends naturally)."""
        rng = random.Random(int.from_bytes(fingerprint[:8], "little"))
        ids: list[int] = []
        if thinking:
            reasoning = self._sentence(rng, rng.randint(6, 24))
            ids += self._template.encode(f"<think>\n{reasoning}\n</think>\n\n")
        ids += self._encode_answer(self._sentence(rng, rng.randint(6, 40)))
        if ignore_eos:
            while len(ids) < max_tokens:
                ids += self._encode_answer(" " + self._sentence(rng, 12))
            return ids[:max_tokens]
        if self._eos is not None:
            ids.append(self._eos)
        return ids[:max_tokens]
