"""Prompt-lookup (n-gram) drafts for speculative decoding.

Why it works: input-grounded generation (a summary that quotes, an answer read out of a
document, a code edit) copies spans of its context. When the last n tokens of prompt + output
appeared before, the tokens that followed them then are a good guess for the next ones, and the
guess costs no weights and no forward pass. The target model verifies every guess in one
forward pass (`workers/engine.py`), so a wrong guess costs only the rows it occupied.

Matching follows vLLM's n-gram proposer and Hugging Face's prompt lookup: the longest suffix of
`prompt_lookup_max` down to `prompt_lookup_min` tokens that occurred earlier; of its earlier
occurrences, the most recent (closest to what is being written now). Pure logic: token ids in,
token ids out.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from workers.core.sequence import Sequence as Request


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
