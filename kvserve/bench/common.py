"""What every benchmark shares: its prompts, its greedy sampling settings, the one percentile
definition, and the loop that runs a batch of greedy requests to the end.

Why one module: a number two reports both call "p99" must mean the same thing, and a workload
two benchmarks both call "the throughput prompts" must be the same token ids. Before this module
`bench serve` interpolated percentiles (numpy) while `kvserve loadtest` took the nearest rank,
and the greedy settings were spelled out four times.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np
import torch

# Token ids below this are kept out of random prompts: the special tokens (BOS, EOS, padding,
# chat markers) sit at the start of the vocabularies kvserve serves.
FIRST_ORDINARY_TOKEN = 100


def make_prompts(vocab_size: int, requests: int, prompt_len: int, seed: int = 0) -> list[list[int]]:
    """Deterministic random token ids, distinct per request (no shared prefix to exploit).

    The same `seed` gives the same prompts in every benchmark, so `bench throughput`, `bench
    serve` and the GPU check time the same work."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(FIRST_ORDINARY_TOKEN, vocab_size, (requests, prompt_len),
                         generator=gen).tolist()


def greedy_params(max_tokens: int, *, ignore_eos: bool = True, **extra: Any) -> dict[str, Any]:
    """Sampling params of a benchmark request: greedy (temperature 0, so every run and every
    setting computes the same tokens) and, by default, `ignore_eos`, so that a request emits
    exactly `max_tokens` tokens and tokens/s compare like for like. `extra`: e.g. logprobs."""
    return {"temperature": 0.0, "max_tokens": max_tokens, "ignore_eos": ignore_eos, **extra}


M = TypeVar("M")
R = TypeVar("R")


def best_of_alternating(modes: Sequence[M], repeats: int, run: Callable[[M], R],
                        seconds: Callable[[R], float],
                        after_each: Callable[[], object] = lambda: None) -> dict[M, R]:
    """Each mode's fastest of `repeats` runs, the modes taking turns and every other round in
    reverse order, so no mode always runs first or after the same neighbour (on a shared
    machine the slow rounds measure its neighbours, so each mode reports its best).
    `after_each` is called after every run (a progress bar's update)."""
    best: dict[M, R] = {}
    for r in range(repeats):
        for mode in (modes if r % 2 == 0 else modes[::-1]):
            result = run(mode)
            if mode not in best or seconds(result) < seconds(best[mode]):
                best[mode] = result
            after_each()
    return best


def percentile(values: Iterable[float], q: float) -> float:
    """The q-th percentile (0 <= q <= 100) of `values`; NaN when there are none.

    Linear interpolation between the two nearest ranks (numpy.percentile's default), the
    definition vLLM's benchmark_serving.py reports its TTFT/ITL p99 with, so kvserve's numbers
    read like theirs. Nearest rank would jump from sample to sample on the small sample counts
    of a short benchmark (with 50 samples, p99 would simply be the maximum)."""
    data = [float(v) for v in values]
    return float(np.percentile(data, q)) if data else math.nan


@dataclass
class GreedyRun:
    """What `run_greedy` measured."""

    tokens: int  # output tokens emitted
    seconds: float
    steps: int
    truncated: bool  # stopped at the time cap, the unfinished requests aborted

    @property
    def tok_s(self) -> float:
        return self.tokens / self.seconds


def run_greedy(
    engine: Any, prompts: list[list[int]], output_len: int, *, cap_s: float | None = None,
    on_tokens: Callable[[int], None] | None = None,
) -> GreedyRun:
    """Submit every prompt at once (greedy, `output_len` tokens each) to an `LLMEngine` and step
    it until all are done, or until `cap_s` seconds have passed (then the rest are aborted and
    the tokens so far count). `on_tokens(n)` after each step: e.g. a progress bar."""
    params = greedy_params(output_len)
    ids = [engine.add_request(prompt_token_ids=p, params=params) for p in prompts]
    tokens, steps, truncated, start = 0, 0, False, time.perf_counter()
    while engine.has_unfinished():
        produced = sum(len(out.token_ids) for out in engine.step())
        tokens, steps = tokens + produced, steps + 1
        if on_tokens is not None:
            on_tokens(produced)
        if cap_s is not None and time.perf_counter() - start > cap_s:
            truncated = True
            for rid in ids:
                engine.abort(rid)
            break
    return GreedyRun(tokens, time.perf_counter() - start, steps, truncated)
