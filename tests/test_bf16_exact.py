"""bf16 end to end on the CPU: greedy output against transformers in bf16, by vLLM's rule.

The rule (`kvserve/bench/exactness.py`): where kvserve and transformers first differ, each
side's token is among the other's top-5 logprobs. Both run bf16 weights, activations and KV
cache on this CPU; norms and logits in fp32 on both sides. How many prompts match fully is
printed (run with -s): bf16's rounding parts some texts at a near-tie (on an Intel Xeon with
AVX512-BF16: 9/13 identical alone, 9/13 concurrent, every difference within the rule). The
engine's projections round each output once from an in-order fp32 sum; transformers' oneDNN
matmuls block the sum differently, so a logit can land one bf16 step away.
"""

from __future__ import annotations

import pytest
import torch

from kvserve.bench.exactness import (
    Greedy,
    compare,
    engine_greedy,
    hf_greedy,
    logprobs_close,
    summary,
)
from kvserve.workers.config import EngineConfig
from kvserve.workers.engine import LLMEngine
from kvserve.workers.model_executor.cpu_kernels import native_bf16
from tests.helpers import assert_engine_idle
from tests.prompts import varied_prompts

NEW_TOKENS = 32


@pytest.fixture(scope="module")
def bf16_engine(real_checkpoint) -> LLMEngine:
    return LLMEngine(EngineConfig(dtype="bfloat16", device="cpu", kv_cache_memory=256 * 1024**2),
                     checkpoint=real_checkpoint)


@pytest.fixture(scope="module")
def prompts(bf16_engine) -> dict[str, list[int]]:
    """The varied prompts; on a CPU without bf16 instructions, without the 1,500-token one.
    There torch multiplies bf16 in a scalar fallback (~1 GFLOP/s) and that prompt's three
    prefills (transformers, alone, concurrent) were ~2/3 of this module's ~190 s on an AVX2-only
    AMD EPYC. Chunked bf16 prefill stays covered there by the tiny model's 150-token prompt in
    64-token chunks below, and with the long prompt on CPUs with bf16 instructions."""
    prompts = varied_prompts(bf16_engine.tokenizer)
    if not native_bf16():
        del prompts["long_1500"]
    return prompts


@pytest.fixture(scope="module")
def reference(model_dir, prompts):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16,
                                              attn_implementation="sdpa").eval()
    return hf_greedy(hf, prompts, NEW_TOKENS)


def test_engine_state_is_bf16(bf16_engine):
    """Weights, KV cache and host tier in bf16; logits in fp32 (what the sampler reads)."""
    assert bf16_engine.info.dtype == "bfloat16"
    assert bf16_engine.model.embed_tokens.weight.dtype == torch.bfloat16
    k, v = bf16_engine.runner.kv_cache[0]
    assert k.dtype == v.dtype == torch.bfloat16


@pytest.mark.parametrize("concurrent", [False, True], ids=["alone", "concurrent"])
def test_greedy_bf16_logprobs_close_to_transformers(bf16_engine, prompts, reference, concurrent):
    ours = engine_greedy(bf16_engine, prompts, NEW_TOKENS, concurrent)
    result = summary(compare(ours, reference))
    print(f"bf16 {'concurrent' if concurrent else 'alone'}: {result['identical']}/"
          f"{result['prompts']} identical, first differences at {result['first_diffs']}")
    assert not result["failed"], result["failed"]
    assert_engine_idle(bf16_engine)


def test_the_rule_rejects_a_token_neither_side_expected():
    """Negative control of the rule: a difference where the tokens are not in each other's
    top-5 fails; one where they are passes; identical outputs pass."""
    ref = Greedy([1, 2, 3], [{1}, {2, 7}, {3}])
    assert logprobs_close("same", Greedy([1, 2, 3], [{1}, {2}, {3}]), ref).first_diff is None
    near = logprobs_close("near", Greedy([1, 7, 9], [{1}, {7, 2}, {9}]), ref)
    assert near.close and near.first_diff == 1
    assert not logprobs_close("far", Greedy([1, 8, 3], [{1}, {8, 2}, {3}]), ref).close
    assert not logprobs_close("one-sided", Greedy([1, 7, 3], [{1}, {7}, {3}]), ref).close


def _tiny_comparison(dtype: str, concurrent: bool, **engine_config) -> dict:
    """A tiny Llama (GQA, chunked prefill, concurrent decodes) in `dtype` against transformers
    in the same dtype. initializer_range 0.3: at the default init a random model's logits are
    nearly flat, every token a near-tie, and the rule could not tell anything apart."""
    from transformers import AutoModelForCausalLM

    from kvserve.workers.model_executor.tiny import tiny_checkpoint

    ckpt = tiny_checkpoint("llama", initializer_range=0.3)
    engine = LLMEngine(EngineConfig(dtype=dtype, device="cpu", kv_cache_memory=4 * 1024**2,
                                    max_num_batched_tokens=64, **engine_config), checkpoint=ckpt)
    hf = AutoModelForCausalLM.from_config(ckpt.config, dtype=getattr(torch, dtype))
    hf.load_state_dict(ckpt.tensors)
    gen = torch.Generator().manual_seed(0)
    prompts = {f"p{n}": torch.randint(100, 40000, (n,), generator=gen).tolist()
               for n in (3, 17, 40, 150)}
    result = summary(compare(engine_greedy(engine, prompts, 16, concurrent),
                             hf_greedy(hf.eval(), prompts, 16)))
    assert_engine_idle(engine)
    assert engine.runner.kv_cache[0][0].dtype == getattr(torch, dtype)
    return result


@pytest.mark.parametrize("concurrent", [False, True], ids=["alone", "concurrent"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_tiny_model_in_reduced_precision_follows_transformers(dtype, concurrent,
                                                              one_torch_thread):
    result = _tiny_comparison(dtype, concurrent)
    assert not result["failed"], result


def test_a_wrong_model_fails_the_rule(one_torch_thread):
    """Negative control on a model: RoPE scaled on our side only (linear x4) breaks it."""
    result = _tiny_comparison("bfloat16", False,
                              rope_parameters={"rope_type": "linear", "factor": 4.0})
    assert len(result["failed"]) >= 2, result
