"""Greedy output against transformers in the same dtype on the same device, by vLLM's rule.

In fp32 kvserve matches `generate()` token for token (tests/test_greedy_exact.py). In bf16 two
correct implementations part ways: a different matmul blocking rounds a logit differently, and
at a near-tie the argmax flips; from there the texts are different continuations. vLLM's
`check_logprobs_close` accepts that, and only that: where the two outputs first differ, each
side's token must be among the other side's top-k logprobs (k=5 here), i.e. both models thought
both tokens likely. Anything after the first difference is not compared.

One implementation serves the CI test (tests/test_bf16_exact.py, CPU) and the GPU check
(`kvserve/bench/gpu_check.py`, CUDA), so both hold kvserve to the same rule.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import torch

from kvserve.bench.common import greedy_params
from kvserve.workers.engine import LLMEngine

TOP_K = 5


@dataclass
class Greedy:
    tokens: list[int]
    top: list[set[int]]  # per generated token: the ids of the top-k logprobs


@dataclass
class Comparison:
    name: str
    tokens: int  # tokens compared (the shorter output)
    matched: int  # identical tokens before the first difference
    first_diff: int | None  # index of the first difference, None: identical
    ours: int | None  # our token there
    ref: int | None  # transformers' token there
    close: bool  # identical, or each token in the other's top-k where they differ

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def hf_greedy(model: Any, prompts: dict[str, list[int]], new_tokens: int) -> dict[str, Greedy]:
    """transformers' `generate()`, greedy, one prompt at a time, with each step's top-k."""
    out: dict[str, Greedy] = {}
    device = next(model.parameters()).device
    with torch.inference_mode():
        for name, ids in prompts.items():
            gen = model.generate(
                torch.tensor([ids], device=device), do_sample=False, max_new_tokens=new_tokens,
                output_logits=True, return_dict_in_generate=True, pad_token_id=0,
            )
            tokens = gen.sequences[0, len(ids):].tolist()
            top = [set(torch.topk(s[0].float(), TOP_K).indices.tolist()) for s in gen.logits]
            out[name] = Greedy(tokens, top)
    return out


def engine_greedy(
    engine: LLMEngine, prompts: dict[str, list[int]], new_tokens: int, concurrent: bool
) -> dict[str, Greedy]:
    """kvserve greedy with top-k logprobs: one request at a time, or arriving in four waves
    while earlier ones decode (so batches mix prefills, chunks and decodes)."""
    params = greedy_params(new_tokens, ignore_eos=False, logprobs=TOP_K)
    names = list(prompts)
    waves = [names[i::4] for i in range(4)] if concurrent else [[n] for n in names]
    by_request: dict[str, str] = {}
    outputs: dict[str, list] = {}

    def collect(outs) -> None:
        for o in outs:
            outputs[o.request_id].append(o)

    for wave in waves:
        for name in wave:
            rid = engine.add_request(prompt_token_ids=prompts[name], params=params)
            by_request[rid], outputs[rid] = name, []
        if concurrent:
            for _ in range(3):
                collect(engine.step())
        else:
            collect(engine.run_until_done())
    collect(engine.run_until_done())
    result = {}
    for rid, outs in outputs.items():
        lps = [lp for o in outs for lp in o.logprobs]
        result[by_request[rid]] = Greedy([lp.token_id for lp in lps],
                                         [{t for t, _ in lp.top} for lp in lps])
    return result


def logprobs_close(name: str, ours: Greedy, ref: Greedy) -> Comparison:
    """vLLM's `check_logprobs_close` rule for one prompt."""
    n = min(len(ours.tokens), len(ref.tokens))
    for i in range(n):
        a, b = ours.tokens[i], ref.tokens[i]
        if a != b:
            close = a in ref.top[i] and b in ours.top[i]
            return Comparison(name, n, i, i, a, b, close)
    # one may stop early at EOS where the other does not: only a prefix if lengths differ,
    # which the rule accepts (both sides chose the same tokens for as long as both ran)
    return Comparison(name, n, n, None, None, None, True)


def compare(ours: dict[str, Greedy], ref: dict[str, Greedy]) -> list[Comparison]:
    return [logprobs_close(name, ours[name], ref[name]) for name in ref]


def summary(comparisons: list[Comparison]) -> dict[str, Any]:
    """JSON-able: how many prompts match fully, how many part at an accepted point, failures."""
    return {
        "prompts": len(comparisons),
        "identical": sum(c.first_diff is None for c in comparisons),
        "close": sum(c.close for c in comparisons),
        "failed": [c.to_dict() for c in comparisons if not c.close],
        "first_diffs": {c.name: c.first_diff for c in comparisons if c.first_diff is not None},
    }
