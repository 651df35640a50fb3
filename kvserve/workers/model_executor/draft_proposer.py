"""Draft-model speculation: a small model that shares the target's tokenizer proposes the next
k tokens of each decoding request, and the target verifies them in its own step.

The draft runs inside the engine's step, before the target is scheduled: one forward pass that
brings each request's draft KV up to date (the whole prompt the first time, afterwards the
tokens the target accepted since), then k - 1 batched decode passes. Its drafts are its greedy
tokens after the request's penalties (the mode of its distribution as the request's sampling
shapes it: temperature, top-k, top-p and min-p never drop the mode), as vLLM v1's draft
proposers give argmax drafts. A deterministic draft is a point mass, which
`rejection_sampler` verifies exactly (greedy output unchanged, sampled output the same tokens
as without speculation for a seeded request).

It keeps its own paged KV cache: its own `ModelRunner` and `BlockManager` (as many blocks as the
target's pool, so it holds the same tokens), and for each request a shadow `Sequence` whose
table and computed count are the draft's. After the target's verification, the draft's KV is
valid up to the target's last token (the accepted drafts are the tokens it computed); what lies
past it is trimmed on the next proposal. A request that the draft's pool cannot hold gets no
drafts until it can.
"""

from __future__ import annotations

import dataclasses

import torch

from kvserve.workers.core.block_manager import BlockManager
from kvserve.workers.core.scheduler import ScheduledChunk
from kvserve.workers.core.sequence import Sequence
from kvserve.workers.model_executor.model_runner import ModelRunner
from kvserve.workers.model_executor.sampler import sample


class DraftModelProposer:
    def __init__(self, runner: ModelRunner, block_manager: BlockManager) -> None:
        self.runner = runner
        self.kv = block_manager
        self.shadows: dict[str, Sequence] = {}  # request id -> the draft's view of it

    def propose(self, requests: list[tuple[Sequence, int]]) -> list[list[int]]:
        """Up to k drafts for each (sequence, k), from batched forward passes of the draft."""
        drafts: list[list[int]] = [[] for _ in requests]
        live = []  # (index, shadow, k) of requests the draft's pool holds this step
        for i, (seq, k) in enumerate(requests):
            if k <= 0:
                continue
            shadow = self._catch_up(seq, k)
            if shadow is not None:
                live.append((i, shadow, k))
        chunks = [ScheduledChunk(s, s.num_tokens - s.num_computed_tokens) for _, s, _ in live]
        for step in range(max((k for _, _, k in live), default=0)):
            if step:  # the drafts so far, one decode row each, for those that want more
                chunks = [ScheduledChunk(s, 1) for _, s, k in live if k > step]
                live = [(i, s, k) for i, s, k in live if k > step]
            tokens = self._greedy(chunks)
            for (i, shadow, _), chunk, token in zip(live, chunks, tokens, strict=True):
                shadow.num_computed_tokens += chunk.num_tokens
                shadow.token_ids.append(token)
                drafts[i].append(token)
        return drafts

    def forget(self, request_id: str) -> None:
        """The request ended: its draft KV blocks go back to the draft's pool."""
        shadow = self.shadows.pop(request_id, None)
        if shadow is not None:
            self.kv.free(shadow)

    def _catch_up(self, seq: Sequence, k: int) -> Sequence | None:
        """The request's shadow, its valid KV trimmed to the target's tokens and room made for
        this step's rows; None (and its draft state dropped) when the pool is too full."""
        shadow = self.shadows.get(seq.request_id)
        if shadow is None:
            # greedy with the request's penalties: the mode of the draft's distribution after
            # the request's sampling steps (temperature, top-k, top-p and min-p keep the mode)
            params = dataclasses.replace(seq.params, temperature=0.0, logprobs=None)
            shadow = Sequence(seq.request_id, seq.prompt_token_ids, params, seq.generator)
            self.shadows[seq.request_id] = shadow
        # valid: the tokens the draft computed that are still the request's (all but the
        # newest, which the target sampled and the draft has not seen)
        valid = min(shadow.num_computed_tokens, seq.num_tokens - 1)
        if shadow.token_ids[:valid] != seq.token_ids[:valid]:
            valid = 0  # (never expected: a request's tokens only grow)
        shadow.num_computed_tokens = valid
        shadow.token_ids = list(seq.token_ids)
        self.kv.trim(shadow, valid)
        # rows: the catch-up through the newest token, then k - 1 drafts fed back
        if self.kv.allocate_slots(shadow, seq.num_tokens + k - 1) is None:
            self.forget(seq.request_id)
            return None
        return shadow

    @torch.inference_mode()
    def _greedy(self, chunks: list[ScheduledChunk]) -> list[int]:
        """One forward pass of the draft over `chunks`: each chunk's next greedy token (after
        its request's penalties)."""
        inp = self.runner.prepare(chunks)
        logits = self.runner.forward(inp)  # [chunks, vocab]: every chunk reaches its end
        tokens, _ = sample(logits, [c.seq for c in inp.sampling])  # greedy: no draw is taken
        token_of = {id(c): t for c, t in zip(inp.sampling, tokens, strict=True)}
        return [token_of[id(c)] for c in chunks]  # (the runner puts decodes first)
