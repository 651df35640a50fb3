"""Continuous batching: every step, running sequences first, then new ones, under one token budget.

Running sequences are served in admission order (a decode costs one token, an unfinished prompt
a chunk of it), so a long prompt is prefilled in chunks and never stalls running decodes. Waiting
sequences join while the budget, `max_num_seqs` and free blocks allow. When a running sequence
cannot get a block, the most recently admitted sequence is preempted: its blocks are freed and it
goes back to the front of the queue. With a host tier that has room, its KV is swapped out (copied
to host blocks) and swapped back in when it resumes; otherwise it is recomputed.

After the model ran, `update_from_output` (as vLLM v1's Scheduler) applies the step: computed
tokens, newly full blocks cached, sampled tokens appended, the stop checks, and finished
sequences freed. The scheduler asks the KV manager (`BlockManager`) for blocks through its
per-request methods and never touches a block table, a prefix hash or a hit counter itself.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Collection
from collections.abc import Sequence as Seqs
from dataclasses import dataclass, field

from kvserve.workers.core.block_manager import BlockManager
from kvserve.workers.core.outputs import SchedulerStats
from kvserve.workers.core.sequence import FinishReason, Sequence, SequenceStatus


@dataclass
class ScheduledChunk:
    seq: Sequence
    num_tokens: int  # tokens computed this step, from seq.num_computed_tokens on, drafts too
    # speculative decoding: draft tokens after the sequence's last one, computed with it and
    # verified by the logits of every one of its rows
    drafts: list[int] = field(default_factory=list)

    @property
    def start(self) -> int:
        return self.seq.num_computed_tokens

    @property
    def is_decode(self) -> bool:
        """The sequence's next token with context before it (and any drafts after it): run as
        decode rows, one per token (`ModelRunner.prepare`)."""
        return self.start > 0 and self.num_tokens == 1 + len(self.drafts)

    @property
    def samples(self) -> bool:
        """The chunk reaches the sequence's last token (and its drafts), so its logits give
        the next token(s)."""
        return self.start + self.num_tokens == self.seq.num_tokens + len(self.drafts)


@dataclass
class SchedulerOutput:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    admitted: list[Sequence] = field(default_factory=list)  # left the queue (new or resumed)

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)


def _num_decoding(running: Seqs[Sequence]) -> int:
    return sum(s.num_tokens - s.num_computed_tokens == 1 for s in running)


class Scheduler:
    def __init__(
        self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
        max_model_len: int | None = None, eos_token_ids: Collection[int] = (),
    ) -> None:
        """`max_model_len` and `eos_token_ids` are for the stop checks of `update_from_output`
        (None: no context limit)."""
        self.kv = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.eos_token_ids = frozenset(eos_token_ids)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in admission order
        self.num_preemptions = 0

    def num_decoding(self) -> int:
        """Running sequences whose next step computes one new token."""
        return _num_decoding(self.running)

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def stats(self) -> SchedulerStats:
        running, waiting = list(self.running), list(self.waiting)  # C-level copies: atomic
        left = (s.num_tokens - s.num_computed_tokens for s in [*running, *waiting])
        return SchedulerStats(
            num_running=len(running), num_waiting=len(waiting),
            num_decoding=_num_decoding(running),
            num_preemptions=self.num_preemptions,
            waiting_kv_blocks=sum(self.kv_blocks_at_longest(s) for s in waiting),
            prompt_tokens_left=sum(n for n in left if n > 1),
        )

    def kv_blocks_at_longest(self, seq: Sequence) -> int:
        """KV blocks `seq` holds at its longest (prompt + max_tokens; with a sliding window,
        at most the window's)."""
        return self.kv.blocks_at_most(seq.num_prompt_tokens + seq.params.max_tokens)

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
            left = seq.num_tokens - seq.num_computed_tokens
            n = min(left + len(seq.spec_token_ids), budget)  # drafts count in the budget
            drafts = seq.spec_token_ids[:n - left] if n > left else []
            while self.kv.allocate_slots(seq, seq.num_computed_tokens + n) is None:
                if drafts:  # drafts are a bet: never worth preempting anyone for
                    n, drafts = n - len(drafts), []
                    continue
                victim = self.running.pop()  # the most recently admitted
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is seq:
                    return budget
            out.chunks.append(ScheduledChunk(seq, n, drafts))
            budget -= n
            i += 1
        return budget

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            computed = self.kv.get_computed_blocks(seq)  # a prefix-cache hit starts it ahead
            n = min(seq.num_tokens - computed, budget)
            if self.kv.allocate_slots(seq, computed + n) is None:
                self.kv.release_computed_blocks(seq)
                break
            self.waiting.popleft()
            self.kv.admit(seq)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            out.admitted.append(seq)
            out.chunks.append(ScheduledChunk(seq, n))
            budget -= n

    def _preempt(self, seq: Sequence) -> None:
        self.num_preemptions += 1
        seq.spec_token_ids = []
        if self.kv.preempt(seq):
            seq.mark_swapped()
        else:
            seq.reset_for_recompute()
        self.waiting.appendleft(seq)

    def update_from_output(
        self, scheduled: SchedulerOutput, sampled: Seqs[Sequence], tokens: Seqs[Seqs[int]],
        stop_string: Callable[[Sequence, int], bool] | None = None,
    ) -> list[FinishReason | None]:
        """Apply a step the model ran: every scheduled chunk's tokens count as computed, the
        blocks they filled are cached, each sampled sequence gets its new tokens, and those
        that stop are finished (their blocks freed at once, in order). Returns each sampled
        sequence's finish reason, None while it goes on.

        A sampled sequence's new tokens are one, or with speculative decoding its accepted
        drafts and the token after them. Drafts that were rejected are not computed: their KV
        slots are given up, and so is a block only they used; only accepted tokens reach the
        prefix cache. The stop checks run token by token, so a stop inside an accepted run cuts
        it there.

        Stop strings are matched on text, by the engine's detokenizer (it needs the tokenizer,
        which the engine owns): `stop_string(seq, token)` takes each new token in order and
        says whether the text now hits one. It is checked before the other stops, so a stop
        string wins over EOS or a length limit in the same token."""
        new_tokens = {id(seq): list(t) for seq, t in zip(sampled, tokens, strict=True)}
        for chunk in scheduled.chunks:
            new = new_tokens.get(id(chunk.seq))
            rejected = len(chunk.drafts) - (len(new) - 1) if chunk.drafts and new else 0
            chunk.seq.num_computed_tokens += chunk.num_tokens - rejected
            if chunk.drafts:
                chunk.seq.num_draft_tokens += len(chunk.drafts)
                chunk.seq.num_accepted_tokens += len(chunk.drafts) - rejected
            chunk.seq.spec_token_ids = []
        reasons: list[FinishReason | None] = []
        for seq in sampled:
            reason = None
            for token in new_tokens[id(seq)]:
                seq.append_token(token)
                hit = stop_string is not None and stop_string(seq, token)
                if (reason := self._check_stop(seq, token, hit)) is not None:
                    break
            # the KV of every token but the newest is in the cache, however many were drafts
            seq.num_computed_tokens = min(seq.num_computed_tokens, seq.num_tokens - 1)
            reasons.append(reason)
        for chunk in scheduled.chunks:
            if chunk.drafts:  # a block that only rejected drafts used goes back to the pool
                self.kv.trim(chunk.seq, chunk.seq.num_computed_tokens)
            self.kv.cache_full_blocks(chunk.seq)
        for seq, reason in zip(sampled, reasons, strict=True):
            if reason is not None:
                self.finish(seq, reason)
        return reasons

    def _check_stop(self, seq: Sequence, token: int, stop_string: bool) -> FinishReason | None:
        p = seq.params
        if stop_string or token in p.stop_token_ids or (
                not p.ignore_eos and token in self.eos_token_ids):
            return FinishReason.STOP
        if len(seq.output_token_ids) >= p.max_tokens or (
                self.max_model_len is not None and seq.num_tokens >= self.max_model_len):
            return FinishReason.LENGTH
        return None

    def finish(self, seq: Sequence, reason: FinishReason) -> None:
        """End a sequence (finished or aborted) and free all of its blocks at once."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        self.kv.free(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
