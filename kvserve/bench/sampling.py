"""`kvserve bench sampling`: output tokens/s with top-k/top-p sampling against greedy, with the
sampler's top-k/top-p decided on each row's most likely tokens (the CPU default) and by a sort
of the whole vocabulary (the baseline), in one run.

The three modes run the same chats on one engine for exactly `output_len` tokens (EOS
ignored), so the batches are the same size at every step and the difference is what sampling
costs. Both sampled modes seed each request alike, so they must draw the same tokens, and the
report says whether they did. Modes alternate within each round; each reports its best of
`repeats` rounds (a shared machine's slow rounds measure its neighbours).
"""

from __future__ import annotations

import contextlib
import time
from typing import Any

from tqdm import tqdm

from kvserve.bench.common import best_of_alternating, greedy_params
from kvserve.bench.structured import PROMPTS
from kvserve.workers.config import EngineConfig
from kvserve.workers.engine import LLMEngine
from kvserve.workers.model_executor.sampler import full_vocabulary_sort

BATCH_SIZES = (1, 32)
MODES = ("greedy", "sampled", "sampled_full_sort")
SAMPLING = {"temperature": 0.8, "top_p": 0.95, "top_k": 0}  # top-p alone: no top-k bounds it


def _run(engine: LLMEngine, batch: int, output_len: int, mode: str, sampling: dict[str, Any]
         ) -> dict[str, Any]:
    """`batch` chats side by side, each `output_len` tokens: tok/s and each request's tokens.
    Request i is seeded 1000 + i in every sampled run, so both sampled modes draw alike."""
    prompts = [p for ps in PROMPTS.values() for p in ps]
    params = greedy_params(output_len)
    sort = full_vocabulary_sort() if mode == "sampled_full_sort" else contextlib.nullcontext()
    with sort:
        start = time.perf_counter()
        ids = [engine.add_request(messages=[{"role": "user", "content": prompts[i % len(prompts)]}],
                                  params=params if mode == "greedy"
                                  else {**params, **sampling, "seed": 1000 + i})
               for i in range(batch)]
        tokens: dict[str, list[int]] = {rid: [] for rid in ids}
        while engine.has_unfinished():
            for out in engine.step():
                tokens[out.request_id] += out.token_ids
        seconds = time.perf_counter() - start
    count = sum(len(t) for t in tokens.values())
    return {"seconds": seconds, "output_tokens": count, "tok_s": count / seconds,
            "token_ids": [tokens[rid] for rid in ids]}


def run_sampling_bench(config: EngineConfig, output_len: int = 64, repeats: int = 2,
                       batch_sizes: tuple[int, ...] = BATCH_SIZES,
                       sampling: dict[str, Any] | None = None, progress: bool = True
                       ) -> dict[str, Any]:
    """Each mode at each batch size: tok/s, sampled against greedy, candidates against the
    full sort."""
    sampling = {**SAMPLING, **(sampling or {})}
    engine = LLMEngine(config)
    for mode in MODES:  # warm-up: kernels, oneDNN shapes
        _run(engine, 2, 4, mode, sampling)
    bar = tqdm(total=len(batch_sizes) * repeats * len(MODES), desc="bench sampling",
               unit="run", disable=not progress)
    rows = []
    for batch in batch_sizes:
        best = best_of_alternating(
            MODES, repeats,
            lambda mode, batch=batch: _run(engine, batch, output_len, mode, sampling),
            lambda run: run["seconds"], bar.update)
        same = best["sampled"].pop("token_ids") == best["sampled_full_sort"].pop("token_ids")
        best["greedy"].pop("token_ids")
        rows.append({"batch": batch, **best, "sampled_equals_full_sort": same,
                     "sampled_vs_greedy": best["sampled"]["tok_s"] / best["greedy"]["tok_s"],
                     "full_sort_vs_greedy": (best["sampled_full_sort"]["tok_s"]
                                             / best["greedy"]["tok_s"]),
                     "speedup_vs_full_sort": (best["sampled"]["tok_s"]
                                              / best["sampled_full_sort"]["tok_s"])})
    bar.close()
    lines = [f"bench sampling: {engine.info.name}, {engine.info.dtype} on {engine.info.device}, "
             f"{output_len} output tokens per request, sampled with {sampling}",
             "batch  greedy tok/s  sampled tok/s  full-sort tok/s  sampled/greedy  "
             "full-sort/greedy  speedup  same tokens"]
    for r in rows:
        lines.append(f"{r['batch']:>5}  {r['greedy']['tok_s']:>12.1f}  "
                     f"{r['sampled']['tok_s']:>13.1f}  {r['sampled_full_sort']['tok_s']:>15.1f}  "
                     f"{r['sampled_vs_greedy']:>14.2f}  {r['full_sort_vs_greedy']:>16.2f}  "
                     f"{r['speedup_vs_full_sort']:>7.2f}  "
                     f"{'yes' if r['sampled_equals_full_sort'] else 'NO'}")
    return {"rows": rows, "output_len": output_len, "sampling": sampling,
            "model": engine.info.name, "dtype": engine.info.dtype,
            "device": engine.info.device, "vocab_size": engine.vocab_size,
            "summary": "\n".join(lines)}
