"""Continuous batching: every step, running sequences first, then new ones, under one token budget.

Running sequences are served in admission order (a decode costs one token, an unfinished prompt
a chunk of it), so a long prompt is prefilled in chunks and never stalls running decodes. Waiting
sequences join while the budget, `max_num_seqs` and free blocks allow. When a running sequence
cannot get a block, the most recently admitted sequence is preempted: its blocks are freed and it
goes back to the front of the queue. With a host tier that has room, its KV is swapped out (copied
to host blocks) and swapped back in when it resumes; otherwise it is recomputed.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from workers.core.block_manager import BlockManager
from workers.core.prefix_hash import extend_block_hashes
from workers.core.sequence import FinishReason, Sequence, SequenceStatus


@dataclass
class ScheduledChunk:
    seq: Sequence
    num_tokens: int  # tokens computed this step, from seq.num_computed_tokens on

    @property
    def start(self) -> int:
        return self.seq.num_computed_tokens

    @property
    def samples(self) -> bool:
        """The chunk reaches the sequence's last token, so its logits give the next token."""
        return self.start + self.num_tokens == self.seq.num_tokens


@dataclass
class SchedulerOutput:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)


class Scheduler:
    def __init__(
        self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int
    ) -> None:
        self.blocks = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in admission order
        self.num_preemptions = 0
        self.prefix_queried_tokens = 0  # prompt tokens looked up in the prefix cache
        self.prefix_hit_tokens = 0  # of which were found cached

    def num_decoding(self) -> int:
        """Running sequences whose next step computes one new token."""
        return sum(s.num_tokens - s.num_computed_tokens == 1 for s in self.running)

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self, budget: int | None = None) -> SchedulerOutput:
        """This step's chunks, within `budget` tokens (default max_num_batched_tokens)."""
        out = SchedulerOutput()
        budget = self._schedule_running(out, budget or self.max_num_batched_tokens)
        if not out.preempted:  # under memory pressure, admit nobody new this step
            self._schedule_waiting(out, budget)
        return out

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            while not self.blocks.can_allocate(seq.block_table, seq.num_computed_tokens + n):
                victim = self.running.pop()  # the most recently admitted
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is seq:
                    return budget
            self.blocks.allocate(seq.block_table, seq.num_computed_tokens + n)
            out.chunks.append(ScheduledChunk(seq, n))
            budget -= n
            i += 1
        return budget

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if self.blocks.enable_caching and not seq.block_table and not seq.host_table:
                self._reuse_prefix(seq)
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            if not self.blocks.can_allocate(seq.block_table, seq.num_computed_tokens + n):
                self._release_prefix(seq)
                break
            self.waiting.popleft()
            if self.blocks.enable_caching and not seq.num_preemptions:
                # once per request: a retry or a resume after preemption is not a new query
                self.prefix_queried_tokens += seq.num_tokens
                self.prefix_hit_tokens += seq.num_computed_tokens
                seq.num_cached_prompt_tokens = seq.num_computed_tokens
            self.blocks.allocate(seq.block_table, seq.num_computed_tokens + n)
            if seq.host_table:
                self.blocks.swap_in(seq.host_table, seq.block_table)
                seq.host_table = []
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            out.chunks.append(ScheduledChunk(seq, n))
            budget -= n

    def _reuse_prefix(self, seq: Sequence) -> None:
        """Start `seq` on the longest cached run of its full blocks; its last token is always
        recomputed (its logits give the next token)."""
        usable = (seq.num_tokens - 1) // self.blocks.block_size
        extend_block_hashes(seq.block_hashes, seq.token_ids, self.blocks.block_size, usable,
                            seq.cache_salt)
        seq.block_table = self.blocks.match_prefix(seq.block_hashes[:usable], seq.token_ids)
        seq.num_cached_blocks = len(seq.block_table)
        seq.num_computed_tokens = seq.num_cached_blocks * self.blocks.block_size

    def _release_prefix(self, seq: Sequence) -> None:
        """`seq` stays waiting: drop its hold on cached blocks (they stay cached)."""
        if seq.host_table:  # swapped out: its KV waits in the host tier
            return
        self.blocks.deallocate(seq.block_table)
        seq.num_computed_tokens = seq.num_cached_blocks = 0

    def cache_full_blocks(self, seqs: list[Sequence]) -> None:
        """After a step: register the blocks it filled, so later requests can reuse them."""
        if not self.blocks.enable_caching:
            return
        size = self.blocks.block_size
        for seq in seqs:
            full = seq.num_computed_tokens // size
            extend_block_hashes(seq.block_hashes, seq.token_ids, size, full, seq.cache_salt)
            for i in range(seq.num_cached_blocks, full):
                self.blocks.cache_block(seq.block_table[i], seq.block_hashes[i],
                                        seq.token_ids[i * size:(i + 1) * size])
            seq.num_cached_blocks = max(seq.num_cached_blocks, full)

    def _preempt(self, seq: Sequence) -> None:
        self.num_preemptions += 1
        if self.blocks.can_swap_out(seq.block_table):
            seq.host_table = self.blocks.swap_out(seq.block_table)
            self.blocks.deallocate(seq.block_table)
            seq.mark_swapped()
        else:
            self.blocks.deallocate(seq.block_table)
            seq.reset_for_recompute()
        self.waiting.appendleft(seq)

    def finish(self, seq: Sequence, reason: FinishReason) -> None:
        """End a sequence (finished or aborted) and free all of its blocks at once."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        self.blocks.deallocate(seq.block_table)
        self.blocks.free_swapped(seq.host_table)
        seq.host_table = []
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
