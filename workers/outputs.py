"""What the engine hands back to callers, one per request per step."""

from __future__ import annotations

from dataclasses import dataclass, field

from workers.sampler import TokenLogprobs


@dataclass
class Usage:
    prompt_tokens: int
    completion_tokens: int
    time_to_first_token_ms: float | None


@dataclass
class RequestOutput:
    request_id: str
    token_ids: list[int]  # new tokens since the previous output
    text: str  # new text since the previous output (never a broken UTF-8 character)
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    finish_reason: str | None = None  # "stop" | "length" | "abort" on the last output
    usage: Usage | None = None  # on the last output

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
