"""Acceptance 1: greedy decoding is token-identical to transformers' generate().

The single tolerance: where two sequences first differ, the reference must show a near-tie (the
two candidate tokens' log-probabilities within 1e-4), as vLLM's logprob-closeness checks do.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from tests.helpers import assert_engine_idle, output_ids
from tests.prompts import varied_prompts

NEW_TOKENS = 64
NEAR_TIE = 1e-4


@pytest.fixture(scope="module")
def prompts(real_engine) -> dict[str, list[int]]:
    return varied_prompts(real_engine.tokenizer)


@pytest.fixture(scope="module")
def reference(hf_model, prompts) -> dict[str, tuple[list[int], list[torch.Tensor]]]:
    """HF greedy tokens and per-step log-probabilities for every prompt."""
    refs = {}
    with torch.inference_mode():
        for name, ids in prompts.items():
            out = hf_model.generate(
                torch.tensor([ids]),
                do_sample=False,
                max_new_tokens=NEW_TOKENS,
                output_logits=True,
                return_dict_in_generate=True,
            )
            tokens = out.sequences[0, len(ids) :].tolist()
            refs[name] = (tokens, [torch.log_softmax(s[0].float(), -1) for s in out.logits])
    return refs


def check_against_reference(name: str, ours: list[int], ref: tuple) -> int:
    """0 if identical, 1 if they part at a proven near-tie; fails otherwise."""
    ref_tokens, ref_logprobs = ref
    if ours == ref_tokens:
        return 0
    i = next((k for k, (a, b) in enumerate(zip(ours, ref_tokens, strict=False)) if a != b), None)
    assert i is not None, (
        f"{name}: one output is a prefix of the other ({len(ours)} vs "
        f"{len(ref_tokens)} tokens) without a differing token"
    )
    gap = abs(float(ref_logprobs[i][ours[i]] - ref_logprobs[i][ref_tokens[i]]))
    assert gap < NEAR_TIE, (
        f"{name}: token {i} differs ({ours[i]} vs HF {ref_tokens[i]}), logprob gap {gap:.2e} "
        "is not a near-tie"
    )
    warnings.warn(f"{name}: near-tie at token {i} (gap {gap:.1e})", stacklevel=2)
    return 1


def greedy(max_tokens: int = NEW_TOKENS) -> dict:
    return {"temperature": 0.0, "max_tokens": max_tokens}


def test_greedy_matches_transformers_one_at_a_time(real_engine, prompts, reference):
    near_ties = 0
    for name, ids in prompts.items():
        outs = real_engine.generate_all([{"prompt_token_ids": ids, "params": greedy()}])
        near_ties += check_against_reference(
            name, output_ids(next(iter(outs.values()))), reference[name]
        )
    assert_engine_idle(real_engine)
    print(f"one at a time: {near_ties} near-ties over {len(prompts)} prompts")


def test_greedy_matches_transformers_concurrent_staggered(real_engine, prompts, reference):
    """Requests arrive in waves while earlier ones decode (and the long one prefills in chunks)."""
    engine = real_engine
    names = list(prompts)
    waves = [names[0:4], names[4:7], names[7:10], names[10:]]
    ids_by_request: dict[str, str] = {}
    outputs: dict[str, list] = {}
    for wave in waves:
        for name in wave:
            rid = engine.add_request(prompt_token_ids=prompts[name], params=greedy())
            ids_by_request[rid] = name
            outputs[rid] = []
        for _ in range(3):  # a few steps before the next wave arrives
            for out in engine.step():
                outputs[out.request_id].append(out)
    while engine.has_unfinished():
        for out in engine.step():
            outputs[out.request_id].append(out)
    near_ties = sum(
        check_against_reference(
            ids_by_request[rid], output_ids(outs), reference[ids_by_request[rid]]
        )
        for rid, outs in outputs.items()
    )
    assert_engine_idle(engine)
    print(f"concurrent: {near_ties} near-ties over {len(prompts)} prompts")


def test_some_prompts_end_early_at_eos(reference):
    """The suite must exercise EOS: at least one greedy reference stops before NEW_TOKENS."""
    assert any(len(tokens) < NEW_TOKENS for tokens, _ in reference.values())
