"""What the engine hands back to callers, one per request per step."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvserve.workers.core.timeline import RequestTimeline


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
    # speculative decoding: draft tokens verified, and of them accepted (completion tokens
    # that cost no step of their own)
    draft_tokens: int = 0
    accepted_draft_tokens: int = 0


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
    # blocks ever written, in either tier: a CPU pool's memory is committed as its blocks are
    # first used (kv_cache._zero_pages; free_blocks.FreeBlocks), so this, not the pool's
    # size, is what it holds in RAM
    device_touched: int
    host_touched: int


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


@dataclass
class SpecDecodeStats:
    """Speculative decoding since the engine started, as vLLM counts it: a draft is one
    request's drafts in one step; its tokens are accepted from the first on, up to the first
    the target model disagrees with."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)  # [i]: drafts accepted there

    def observe(self, num_draft_tokens: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        grow = num_accepted - len(self.accepted_per_position)
        if grow > 0:
            self.accepted_per_position += [0] * grow
        for i in range(num_accepted):
            self.accepted_per_position[i] += 1

    @property
    def acceptance_rate(self) -> float | None:
        """Accepted / proposed draft tokens; None before any draft."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else None

    @property
    def mean_accepted_length(self) -> float | None:
        """Tokens a verified step emits per request on average: its accepted drafts and the
        target's own next token (vLLM's mean acceptance length); None before any draft."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else None
