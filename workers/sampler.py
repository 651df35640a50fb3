"""Per-request sampling from a batch of logits.

Order, for each row: repetition penalty (prompt and output tokens, HF/CTRL style: positive logits
divided, negative multiplied) -> presence and frequency penalties (output tokens, OpenAI style) ->
temperature (0: greedy argmax) -> top-k -> top-p (the most likely token always survives) ->
min-p (relative to the most likely token) -> a draw from the request's own generator, so a seeded
request gets the same tokens whatever else is in the batch. Reported logprobs are those of the raw
model distribution, before any of the above.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from workers.sampling_params import SamplingParams
from workers.sequence import Sequence


@dataclass
class TokenLogprobs:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # the n most likely (token id, logprob), best first


def sample(
    logits: torch.Tensor, seqs: list[Sequence]
) -> tuple[list[int], list[TokenLogprobs | None]]:
    """logits: [seqs, vocab] fp32 -> one next token per sequence, and its logprobs if asked."""
    tokens = torch.empty(len(seqs), dtype=torch.long)
    plain_greedy = [i for i, s in enumerate(seqs) if s.params.greedy and not _penalized(s.params)]
    if plain_greedy:  # the common case, batched
        tokens[plain_greedy] = logits[plain_greedy].argmax(dim=-1).cpu()
    done = set(plain_greedy)
    for i, seq in enumerate(seqs):
        if i not in done:
            tokens[i] = _sample_row(logits[i], seq)
    token_list = tokens.tolist()
    return token_list, [
        _logprobs(logits[i], t, s.params)
        for i, (t, s) in enumerate(zip(token_list, seqs, strict=True))
    ]


def _penalized(p: SamplingParams) -> bool:
    return p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0


def _sample_row(logits: torch.Tensor, seq: Sequence) -> int:
    p = seq.params
    logits = apply_penalties(logits.clone(), seq) if _penalized(p) else logits
    if p.greedy:
        return int(logits.argmax())
    logits = logits / p.temperature
    logits = apply_top_k(logits, p.top_k)
    logits = apply_top_p(logits, p.top_p)
    probs = apply_min_p(torch.softmax(logits, dim=-1), p.min_p)
    return int(torch.multinomial(probs.cpu(), 1, generator=seq.generator))


def apply_penalties(logits: torch.Tensor, seq: Sequence) -> torch.Tensor:
    """logits: [vocab], modified in place."""
    p = seq.params
    if p.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(seq.token_ids)), dtype=torch.long, device=logits.device)
        scores = logits[seen]
        logits[seen] = torch.where(
            scores > 0, scores / p.repetition_penalty, scores * p.repetition_penalty
        )
    if seq.output_token_ids and (p.presence_penalty or p.frequency_penalty):
        out = torch.tensor(seq.output_token_ids, dtype=torch.long, device=logits.device)
        counts = torch.bincount(out, minlength=logits.shape[-1]).to(logits.dtype)
        logits -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(logits.dtype)
    return logits


def apply_top_k(logits: torch.Tensor, k: int) -> torch.Tensor:
    if k <= 0 or k >= logits.shape[-1]:
        return logits
    kth = torch.topk(logits, k).values[-1]
    return logits.masked_fill(logits < kth, float("-inf"))


def apply_top_p(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    if top_p >= 1.0:
        return logits
    sorted_logits, order = torch.sort(logits, descending=True)
    probs = torch.softmax(sorted_logits, dim=-1)
    before = torch.cumsum(probs, dim=-1) - probs  # mass strictly ahead of each token
    drop = before >= top_p
    drop[0] = False  # always keep the most likely token
    unsorted = torch.empty_like(drop).scatter_(0, order, drop)
    return logits.masked_fill(unsorted, float("-inf"))


def apply_min_p(probs: torch.Tensor, min_p: float) -> torch.Tensor:
    if min_p <= 0.0:
        return probs
    return probs.masked_fill(probs < min_p * probs.max(), 0.0)


def _logprobs(logits: torch.Tensor, token: int, p: SamplingParams) -> TokenLogprobs | None:
    if p.logprobs is None:
        return None
    logp = torch.log_softmax(logits, dim=-1)
    top = torch.topk(logp, p.logprobs) if p.logprobs else None
    pairs = list(zip(top.indices.tolist(), top.values.tolist(), strict=True)) if top else []
    return TokenLogprobs(token, float(logp[token]), pairs)
