"""Seeded request generators for the Locust users: what each workload sends.

Every generator draws from its own `random.Random(seed)`, so two runs offer the same sequence of
requests. Prompts are plain text or chat messages; lengths are approximate (words, not tokens).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

PROSE = Path(__file__).resolve().parents[2] / "evals" / "data" / "haystack_prose.txt"
TOPICS = ["caching", "compilers", "rivers", "databases", "orbits", "glaciers", "markets",
          "bridges", "proteins", "volcanoes"]
# mixed: (prompt words, output tokens) drawn with these weights
MIXED_SHAPES = [((40, 32), 0.4), ((200, 64), 0.3), ((800, 128), 0.2), ((1500, 64), 0.1)]


@dataclass
class Request:
    params: dict
    prompt: str | None = None
    messages: list[dict[str, str]] | None = None


def prose_words(rng: random.Random, count: int) -> str:
    words = PROSE.read_text().split()
    start = rng.randrange(0, max(1, len(words) - count))
    return " ".join(words[start:start + count])


def short_chat(rng: random.Random) -> Request:
    question = f"In two sentences, what should a beginner know about {rng.choice(TOPICS)}?"
    return Request({"max_tokens": 64, "temperature": 0.7, "seed": rng.randrange(2**31)},
                   messages=[{"role": "user", "content": question}])


def long_prompt(rng: random.Random) -> Request:
    """About 2,000 tokens of prose, then a question about it."""
    text = prose_words(rng, 1500)
    return Request({"max_tokens": 64, "temperature": 0, "seed": rng.randrange(2**31)},
                   prompt=f"{text}\n\nSummarise the text above in one sentence:")


def mixed(rng: random.Random) -> Request:
    shapes, weights = zip(*MIXED_SHAPES, strict=True)
    words, output = rng.choices(shapes, weights)[0]
    return Request({"max_tokens": output, "temperature": 0.7, "seed": rng.randrange(2**31),
                    "ignore_eos": True}, prompt=prose_words(rng, words))


class Conversation:
    """A multi-turn chat: a shared system prompt and a growing history (prefix caching)."""

    SYSTEM = ("You are the support assistant of a logistics company. Rules: parcels over 30 kg "
              "ship as freight; refunds need a receipt; weekend delivery costs extra; addresses "
              "need a postcode; fragile goods need double boxing. Answer briefly.")

    def __init__(self, rng: random.Random, turns: int = 5) -> None:
        self.rng, self.turns, self.history = rng, turns, []

    def next_request(self) -> Request:
        if len(self.history) >= 2 * self.turns:
            self.history = []  # a new conversation
        topic, number = self.rng.choice(TOPICS), self.rng.randrange(999)
        question = f"Question about {topic} parcel number {number}?"
        self.history.append({"role": "user", "content": question})
        return Request({"max_tokens": 48, "temperature": 0, "seed": self.rng.randrange(2**31)},
                       messages=[{"role": "system", "content": self.SYSTEM}, *self.history])

    def answered(self, text: str) -> None:
        self.history.append({"role": "assistant", "content": text})
