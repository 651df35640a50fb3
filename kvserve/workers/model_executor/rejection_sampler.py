"""Verifying speculative drafts: which of a request's draft tokens the target model accepts.

A request with k drafts was computed as k + 1 decode rows (`ModelRunner.prepare`): row j is the
decode step that would follow the last token and drafts 0..j-1. Each row is sampled as that
decode step would sample it (`sampler.sample`, with the penalties seeing drafts 0..j-1 as
output), and drafts are accepted while the row's token equals the draft. The new tokens are the
accepted drafts and the next row's token.

Why this is exact. Greedy: each row's token is the argmax the plain decode would take, so the
longest agreeing prefix plus one more is what greedy decoding writes. Sampled: a draft from a
deterministic proposer (prompt lookup) is a point mass q = 1{d}. The rejection sampling of
Leviathan et al. and Chen et al. then accepts d with probability min(1, p(d) / q(d)) = p(d) and
on rejection draws from the residual (p - q)+, which is p without d, renormalised. Drawing x ~ p
and accepting when x = d has exactly those probabilities. Here each row draws its token with
the request's own next uniform, and the generator is then rewound so that every emitted token
consumed exactly one uniform, in order: a seeded request's tokens are the very tokens it would
get without speculation (not only their distribution), whatever the batch and the drafts.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvserve.workers.core.outputs import TokenLogprobs
from kvserve.workers.core.scheduler import ScheduledChunk
from kvserve.workers.core.sequence import Sequence
from kvserve.workers.model_executor.sampler import sample


@dataclass
class Verified:
    """One sampling chunk's outcome."""

    token_ids: list[int]  # the new tokens: accepted drafts, then one more
    logprobs: list[TokenLogprobs] = field(default_factory=list)  # per new token, when asked
    num_drafts: int = 0  # drafts verified
    num_accepted: int = 0  # of which accepted


class _DraftRow:
    """Row j of a chunk with drafts, as the sampler sees a sequence: the request as it would be
    had drafts 0..j-1 been generated (its penalties count them)."""

    __slots__ = ("seq", "drafts")

    def __init__(self, seq: Sequence, drafts: list[int]) -> None:
        self.seq, self.drafts = seq, drafts

    @property
    def params(self):
        return self.seq.params

    @property
    def generator(self) -> torch.Generator:
        return self.seq.generator

    @property
    def num_prompt_tokens(self) -> int:
        return self.seq.num_prompt_tokens

    @property
    def num_tokens(self) -> int:
        return self.seq.num_tokens + len(self.drafts)

    @property
    def token_ids(self) -> list[int]:
        return self.seq.token_ids + self.drafts


def sample_and_verify(logits: torch.Tensor, chunks: list[ScheduledChunk]) -> list[Verified]:
    """logits: [rows, vocab], one row per sampling chunk, k + 1 for a chunk with k drafts (in
    `chunks` order) -> each chunk's new tokens."""
    rows: list[Sequence | _DraftRow] = []
    rewind: dict[int, torch.Tensor] = {}  # chunk index -> its generator's state before the draws
    for i, c in enumerate(chunks):
        if not c.drafts:
            rows.append(c.seq)
            continue
        rows += [_DraftRow(c.seq, c.drafts[:j]) for j in range(len(c.drafts) + 1)]
        if not c.seq.params.greedy:
            rewind[i] = c.seq.generator.get_state()
    tokens, logprobs = sample(logits, rows)  # type: ignore[arg-type]  (rows quack as Sequence)
    out: list[Verified] = []
    at = 0
    for i, c in enumerate(chunks):
        n = len(c.drafts) + 1
        got, lps = tokens[at:at + n], logprobs[at:at + n]
        at += n
        accepted = 0
        while accepted < len(c.drafts) and got[accepted] == c.drafts[accepted]:
            accepted += 1
        if i in rewind:  # one uniform per emitted token, as decode steps would have used
            generator = c.seq.generator
            generator.set_state(rewind[i])
            for _ in range(accepted + 1):  # (scalar draws: the sampler's own, one each)
                torch.rand((), generator=generator)
        kept = got[:accepted + 1]
        out.append(Verified(kept, [lp for lp in lps[:accepted + 1] if lp is not None],
                            len(c.drafts), accepted))
    return out
