"""What the engine hands back to callers, one per request per step."""

from __future__ import annotations

from dataclasses import dataclass, field

from workers.core.timeline import RequestTimeline


@dataclass
class TokenLogprobs:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # the n most likely (token id, logprob), best first


@dataclass
class Usage:
    prompt_tokens: int
    completion_tokens: int
    time_to_first_token_ms: float | None
    cached_tokens: int = 0  # prompt tokens served from the prefix cache


@dataclass
class RequestOutput:
    request_id: str
    token_ids: list[int]  # new tokens since the previous output
    text: str  # new text since the previous output (never a broken UTF-8 character)
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    finish_reason: str | None = None  # "stop" | "length" | "abort" on the last output
    usage: Usage | None = None  # on the last output
    timeline: RequestTimeline | None = None  # on the last output, unless recording is off

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(frozen=True)
class KVManagerStats:
    """A snapshot of the KV manager: block counts now, and counters since it started."""

    device_blocks: int
    device_used: int  # referenced by live requests
    device_cached: int  # unreferenced, kept for prefix hits (counted free)
    host_blocks: int  # the CPU offload tier; 0 when off
    host_used: int  # cached + swapped
    host_cached: int
    prefix_queried_tokens: int  # prompt tokens looked up (once per request)
    prefix_hit_tokens: int  # of which were found cached (either tier)
    blocks_offloaded: int
    blocks_restored: int
    blocks_swapped_out: int
    blocks_swapped_in: int


@dataclass(frozen=True)
class KVCacheStats(KVManagerStats):
    """The engine's snapshot of the KV cache: the KV manager's, plus what the engine counts
    (preemptions, the bytes and time of device <-> host copies)."""

    preemptions: int
    swap_bytes: int  # bytes copied between device and host, all four kinds
    swap_seconds: float


@dataclass(frozen=True)
class SchedulerStats:
    """A snapshot of the queues (vLLM's SchedulerStats), for admission control and status.
    Taken from copies of the queues, so it can be read while a step runs on another thread."""

    num_running: int
    num_waiting: int
    num_decoding: int  # running sequences whose next step computes one token
    num_preemptions: int  # since the scheduler started
    waiting_kv_blocks: int  # KV blocks the waiting sequences hold at their longest
    # tokens the queued work still has to compute before its next token, a decode's one not
    # counted (it is that decode's share of every step): what delays a new request's first token
    prompt_tokens_left: int
