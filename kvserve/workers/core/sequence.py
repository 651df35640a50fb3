"""A request's state inside the engine."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from kvserve.workers.core.sampling_params import SamplingParams
from kvserve.workers.core.timeline import TimelineEvent


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(enum.StrEnum):
    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_tokens or the model's context
    ABORT = "abort"


@dataclass
class Sequence:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    generator: torch.Generator  # per-request RNG: seeded output ignores the rest of the batch
    arrival_time: float = field(default_factory=time.perf_counter)  # the timeline's clock
    output_token_ids: list[int] = field(default_factory=list)
    token_ids: list[int] = field(init=False)  # prompt + output
    num_computed_tokens: int = 0  # tokens whose K/V are in the cache
    block_table: list[int] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: FinishReason | None = None
    first_token_time: float | None = None
    num_preemptions: int = 0
    # part of every block hash: the tenant's salt (tenants never share KV), plus what a long
    # prompt's RoPE rotations depend on (engine: `_salt`)
    cache_salt: str = ""
    block_hashes: list[bytes] = field(default_factory=list)  # of its full blocks, chained
    num_cached_blocks: int = 0  # leading blocks registered for (or taken from) prefix caching
    num_cached_prompt_tokens: int = 0  # prompt tokens a prefix-cache hit spared, at admission
    host_table: list[int] = field(default_factory=list)  # swapped out: its KV in host blocks
    events: list[TimelineEvent] = field(default_factory=list)  # its timeline, when recorded
    # speculative decoding: the draft tokens proposed to follow token_ids, verified next step
    spec_token_ids: list[int] = field(default_factory=list)
    num_draft_tokens: int = 0  # drafts verified so far
    spec_len: int = 0  # drafts to ask for next step (0: the most, num_speculative_tokens)
    num_accepted_tokens: int = 0  # of which the target model accepted
    # structured outputs: the grammar matcher of its constraint (an xgrammar GrammarMatcher,
    # advanced by every output token; kvserve.workers.structured_output), None if unconstrained
    grammar: Any = None

    def __post_init__(self) -> None:
        self.token_ids = list(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)
        self.output_token_ids.append(token_id)
        if self.first_token_time is None:
            self.first_token_time = time.perf_counter()

    def mark_swapped(self) -> None:
        """After preemption with swap: the KV waits in `host_table`, nothing is recomputed."""
        self.num_cached_blocks = 0  # its new device blocks are registered again on resume
        self.num_preemptions += 1
        self.status = SequenceStatus.WAITING

    def reset_for_recompute(self) -> None:
        """After preemption: the KV is gone, every token (prompt and output) is recomputed."""
        self.num_computed_tokens = 0
        self.num_cached_blocks = 0
        self.num_preemptions += 1
        self.status = SequenceStatus.WAITING
