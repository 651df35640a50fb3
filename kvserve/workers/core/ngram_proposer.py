"""Prompt-lookup (n-gram) drafts for speculative decoding.

Why it works: input-grounded generation (a summary that quotes, an answer read out of a
document, a code edit) copies spans of its context. When the last n tokens of prompt + output
appeared before, the tokens that followed them then are a good guess for the next ones, and the
guess costs no weights and no forward pass. The target model verifies every guess in one
forward pass (`kvserve/workers/engine.py`), so a wrong guess costs only the rows it occupied.

Matching follows vLLM's n-gram proposer and Hugging Face's prompt lookup: the longest suffix of
`prompt_lookup_max` down to `prompt_lookup_min` tokens that occurred earlier; of its earlier
occurrences, the most recent (closest to what is being written now). Pure logic: token ids in,
token ids out.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from kvserve.workers.core.sequence import Sequence as Request


class NgramProposer:
    def __init__(self, min_n: int, max_n: int) -> None:
        if not 0 < min_n <= max_n:
            raise ValueError(f"prompt_lookup_min ({min_n}) must be in [1, prompt_lookup_max "
                             f"({max_n})]")
        self.min_n, self.max_n = min_n, max_n

    def propose(self, requests: list[tuple[Request, int]]) -> list[list[int]]:
        """Up to k drafts for each (sequence, k): the proposer interface the engine calls
        (with `forget` when a request ends; prompt lookup keeps no state)."""
        return [self.lookup(seq.token_ids, k) for seq, k in requests]

    def forget(self, request_id: str) -> None:
        pass

    def lookup(self, token_ids: Sequence[int], k: int) -> list[int]:
        """Up to `k` draft tokens to follow `token_ids` (prompt + output); [] when no n-gram of
        the allowed sizes recurs."""
        if k <= 0 or len(token_ids) <= self.min_n:
            return []
        arr = np.asarray(token_ids, dtype=np.int64)
        # ends of earlier occurrences of the last token (not the last token itself)
        ends = np.flatnonzero(arr[:-1] == arr[-1])  # [candidates]
        length = np.ones_like(ends)  # [candidates]: how far each match reaches back
        alive = np.ones(ends.shape, dtype=bool)
        for back in range(1, min(self.max_n, len(arr))):
            prev = ends - back
            alive &= prev >= 0
            alive[alive] = arr[prev[alive]] == arr[-1 - back]
            if not alive.any():
                break
            length += alive
        if not ends.size or (n := int(length.max())) < self.min_n:
            return []
        follow = int(ends[length >= n][-1]) + 1  # the most recent of the longest matches
        return arr[follow:follow + k].tolist()


@dataclass(frozen=True)
class LookupCeiling:
    """The most any prompt-lookup proposer could do for one request (`lookup_ceiling`)."""

    decode_tokens: int  # the output's tokens after the first (the prefill step writes that one)
    fewest_steps: int  # the fewest verifying steps that write them

    @property
    def tokens_per_step(self) -> float:
        return self.decode_tokens / self.fewest_steps if self.fewest_steps else 1.0


def lookup_ceiling(prompt: Sequence[int], output: Sequence[int], k: int) -> LookupCeiling:
    """The fewest decode steps in which a request could have written `output` (its greedy
    tokens after `prompt`) if, at every step, its up-to-`k` drafts were the continuation of the
    best earlier occurrence of its last token in prompt + output so far: an oracle choosing
    among every candidate prompt lookup has, for any `prompt_lookup_min`/`max` (a longer match
    is also a match of the last token). No prompt-lookup proposer writes more tokens per step.

    Why it is worth computing: a verifying step costs at least a plain decode step, so at batch
    1 the decode-phase speedup of *any* prompt-lookup proposer on this output is at most
    `tokens_per_step`. When a benchmark falls short of a target, this says whether a better
    proposer could reach it or whether the output simply does not copy its context enough.
    Exact: the fewest steps come from dynamic programming over the positions, not a greedy
    walk."""
    ids = np.asarray([*prompt, *output], dtype=np.int64)
    p, n_out = len(prompt), len(output)
    if n_out <= 1:
        return LookupCeiling(max(n_out - 1, 0), 0)
    out = ids[p:]
    best = np.zeros(n_out, dtype=np.int64)  # best[n]: most drafts accepted while writing out[n]
    for n in range(1, n_out):
        end = p + n  # the context is ids[:end]; the drafts continue an occurrence of ids[end-1]
        starts = np.flatnonzero(ids[:end - 1] == ids[end - 1]) + 1  # [candidates]
        accepted = np.zeros(starts.shape, dtype=np.int64)
        alive = np.ones(starts.shape, dtype=bool)
        for j in range(min(k, n_out - n)):  # a draft may be the last token itself (EOS)
            pos = starts + j
            alive &= pos < end
            alive[alive] = ids[pos[alive]] == out[n + j]
            if not alive.any():
                break
            accepted += alive
        best[n] = accepted.max(initial=0)
    fewest = np.zeros(n_out + 1, dtype=np.int64)  # fewest[n]: steps from out[n] to the end
    for n in range(n_out - 1, 0, -1):
        fewest[n] = 1 + min(fewest[min(n_out, n + a + 1)] for a in range(int(best[n]) + 1))
    return LookupCeiling(n_out - 1, int(fewest[1]))
