"""The engine's measured token throughput, for time-based admission and step sizing.

Only steps that spend at least half their token budget count: those are the steps a backlog of
prompts runs at, so the rate says how fast queued prompt work drains on this hardware (a GPU or
a 2-core CPU alike) without a per-machine setting. `token_budget` sizes the next step from it.
"""

from __future__ import annotations

from dataclasses import dataclass

MIN_PROMPT_CHUNK = 16  # prompt tokens a step carries at least, however tight the latency target


@dataclass
class PrefillRate:
    budget: int  # max_num_batched_tokens
    smoothing: float = 0.2  # weight of the newest step in the moving average
    tokens_per_s: float | None = None  # None until a full enough step was seen

    def observe(self, tokens: int, seconds: float, budget: int | None = None) -> None:
        """A step computed `tokens` in `seconds` under `budget` (default: the full one)."""
        if tokens < (budget or self.budget) / 2 or seconds <= 0:
            return
        rate = tokens / seconds
        old = self.tokens_per_s
        self.tokens_per_s = rate if old is None else old + self.smoothing * (rate - old)

    def token_budget(self, decoding: int, step_ms: float | None) -> int:
        """The next step's token budget: the full one, or while `decoding` sequences wait for
        their next token, what fits in `step_ms` at the measured rate (their inter-token
        latency), never less than the decodes plus a chunk of prompt, so prompts progress."""
        if step_ms is None or self.tokens_per_s is None or decoding == 0:
            return self.budget
        fits = int(self.tokens_per_s * step_ms / 1000)
        return min(self.budget, max(decoding + MIN_PROMPT_CHUNK, fits))

    def seconds_for(self, tokens: int, decoding: int = 0, step_ms: float | None = None
                    ) -> float | None:
        """Expected seconds to compute `tokens` prompt tokens while `decoding` sequences take
        one token of every step's budget each (the budget `token_budget` gives for `step_ms`,
        so a tight latency target leaves prompts a smaller share); None before any measurement."""
        if self.tokens_per_s is None:
            return None
        budget = self.token_budget(decoding, step_ms)
        share = max(0.1, 1 - decoding / budget)
        return tokens / (self.tokens_per_s * share)
