"""Every supported architecture against transformers' own model on the same random weights.

The reference is `AutoModelForCausalLM.from_config(ckpt.config)` + `load_state_dict(ckpt.tensors)`
and its greedy `generate()`; never the engine itself. Weights use a larger init range than HF's
default and random norm weights and biases (HF initialises those to exactly 1 and 0, which would
hide a dropped bias or a misloaded norm), so outputs depend on every tensor and on the context.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest
import torch

from kvserve.workers.config import EngineConfig
from kvserve.workers.core.outputs import TokenLogprobs
from kvserve.workers.engine import LLMEngine
from kvserve.workers.model_executor.loader import LoadedCheckpoint
from tests.helpers import assert_engine_idle, noisy_checkpoint, output_ids

pytestmark = pytest.mark.usefixtures("one_torch_thread")

GEMMA2 = {"sliding_window": 32, "query_pre_attn_scalar": 16, "attn_logit_softcapping": 2.0,
          "final_logit_softcapping": 3.0, "tie_word_embeddings": False}
GEMMA3 = {"sliding_window": 32, "query_pre_attn_scalar": 16, "tie_word_embeddings": False,
          "layer_types": ["sliding_attention", "full_attention"],
          "rope_scaling": {"rope_type": "linear", "factor": 8.0}}
MIXTRAL = {"num_local_experts": 4, "num_experts_per_tok": 2}
MODELS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama-tied": ("llama", {}),
    "llama-untied": ("llama", {"tie_word_embeddings": False}),
    "qwen2": ("qwen2", {}),  # q/k/v carry biases, o_proj does not
    "mistral": ("mistral", {}),
    "qwen3": ("qwen3", {}),  # q and k RMS-normalised per head before RoPE
    "phi3": ("phi3", {}),  # q/k/v and gate/up fused in the checkpoint
    # local (32-token window) and global layers, sandwich norms of (1 + w), GeGLU, scaled
    # embeddings; caps low enough to bend these small random scores and logits. Untied: a
    # tiny random Gemma with tied embeddings echoes its last token (its embeddings, scaled by
    # sqrt(hidden), outweigh two random layers)
    "gemma2": ("gemma2", GEMMA2),
    # Gemma 2's layer without caps, with q/k norms and a RoPE per layer type: the local
    # layer's base 10,000, the global one's 1,000,000 with linear scaling
    "gemma3": ("gemma3_text", GEMMA3),
    # 4 experts, 2 per token: a sparse MoE in place of each MLP
    "mixtral": ("mixtral", MIXTRAL),
}
PROMPT_LENS = (5, 37, 70)  # 70 spans five 16-token blocks; 37 and 70 need several 32-token chunks
NEW_TOKENS = 12
TOP_N = 5
ATOL = 1e-4


@dataclass
class Reference:
    tokens: list[int]  # greedy tokens from HF generate
    logprobs: torch.Tensor  # [NEW_TOKENS, vocab] HF log-softmax at each generated position


@dataclass
class Case:
    ckpt: LoadedCheckpoint
    prompts: list[list[int]]
    refs: list[Reference]




def _hf_model(ckpt: LoadedCheckpoint) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(ckpt.config, dtype=torch.float32)
    model.load_state_dict(ckpt.tensors)
    return model.eval()


def _hf_greedy(model: torch.nn.Module, prompt: list[int], n: int) -> Reference:
    ids = torch.tensor([prompt])
    out = model.generate(
        ids, attention_mask=torch.ones_like(ids), do_sample=False, min_new_tokens=n,
        max_new_tokens=n, return_dict_in_generate=True, output_logits=True, pad_token_id=0,
    )
    logits = torch.cat(out.logits).float()  # raw logits, before min_new_tokens masks eos
    return Reference(out.sequences[0, len(prompt):].tolist(), torch.log_softmax(logits, dim=-1))


@pytest.fixture(scope="module", params=list(MODELS))
def case(request: pytest.FixtureRequest) -> Case:
    model_type, overrides = MODELS[request.param]
    ckpt = noisy_checkpoint(model_type, **overrides)
    gen = torch.Generator().manual_seed(2)
    vocab = ckpt.config.vocab_size
    prompts = [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in PROMPT_LENS]
    hf = _hf_model(ckpt)
    with torch.inference_mode():
        refs = [_hf_greedy(hf, p, NEW_TOKENS) for p in prompts]
    return Case(ckpt, prompts, refs)


def _engine(ckpt: LoadedCheckpoint, **config: Any) -> LLMEngine:
    config.setdefault("kv_cache_memory", 4 * 1024**2)
    return LLMEngine(EngineConfig(device="cpu", **config), checkpoint=ckpt)


def _params(n: int) -> dict[str, Any]:
    return {"temperature": 0.0, "max_tokens": n, "ignore_eos": True, "logprobs": TOP_N}


def _assert_logprobs_match(steps: list[TokenLogprobs], ref: Reference, where: str) -> None:
    assert len(steps) == len(ref.tokens), where
    for i, step in enumerate(steps):
        hf = ref.logprobs[i]
        ids = torch.tensor([t for t, _ in step.top])
        values = torch.tensor([lp for _, lp in step.top])
        msg = f"{where}, step {i}"
        assert len(step.top) == TOP_N, msg
        # the engine's top-n equal HF's top-n values, and HF gives those ids those logprobs
        torch.testing.assert_close(values, hf.topk(TOP_N).values, atol=ATOL, rtol=0, msg=msg)
        torch.testing.assert_close(values, hf[ids], atol=ATOL, rtol=0, msg=msg)
        torch.testing.assert_close(
            torch.tensor(step.logprob), hf[step.token_id], atol=ATOL, rtol=0, msg=msg
        )


def test_checkpoint_exercises_the_architecture(case: Case) -> None:
    """Guards the other tests against a vacuous setup."""
    cfg, tensors = case.ckpt.config, case.ckpt.tensors
    bias = "model.layers.0.self_attn.q_proj.bias"
    if cfg.model_type == "qwen2":
        assert bias in tensors and tensors[bias].abs().max() > 0.05
        assert "model.layers.0.self_attn.o_proj.bias" not in tensors
    else:
        assert bias not in tensors
    if not cfg.tie_word_embeddings:
        assert not torch.equal(tensors["lm_head.weight"], tensors["model.embed_tokens.weight"])
    eos = case.ckpt.tokenizer.eos_token_id
    for ref in case.refs:
        # HF's min_new_tokens hides eos; the engine's ignore_eos does not, so eos must not win
        assert eos not in ref.tokens
        assert len(set(ref.tokens)) > 1  # not a degenerate one-token loop
    # the context matters at the tolerance used: a changed first token moves the last logits
    hf = _hf_model(case.ckpt)
    prompt = torch.tensor([case.prompts[2]])
    changed = prompt.clone()
    changed[0, 0] = (changed[0, 0] + 1) % cfg.vocab_size
    with torch.inference_mode():
        a = torch.log_softmax(hf(prompt).logits[0, -1], -1)
        b = torch.log_softmax(hf(changed).logits[0, -1], -1)
    assert (a - b).abs().max() > 100 * ATOL


def test_greedy_matches_hf_one_at_a_time(case: Case) -> None:
    engine = _engine(case.ckpt)
    for prompt, ref in zip(case.prompts, case.refs, strict=True):
        out = engine.generate_all([dict(prompt_token_ids=prompt, params=_params(NEW_TOKENS))])
        (stream,) = out.values()
        where = f"prompt of {len(prompt)}"
        _assert_logprobs_match([lp for o in stream for lp in o.logprobs], ref, where)
        assert output_ids(stream) == ref.tokens, where
        assert stream[-1].finish_reason == "length"
        assert_engine_idle(engine)


@pytest.mark.parametrize("budget", [32, 512], ids=["chunked-prefill", "full-prefill"])
def test_greedy_matches_hf_batched(case: Case, budget: int) -> None:
    """All prompts at once; with a budget of 32 the long ones prefill in chunks next to decodes."""
    engine = _engine(case.ckpt, max_num_batched_tokens=budget)
    requests = [dict(prompt_token_ids=p, params=_params(NEW_TOKENS)) for p in case.prompts]
    out = engine.generate_all(requests)
    assert len(out) == len(case.prompts)
    for (rid, stream), prompt, ref in zip(out.items(), case.prompts, case.refs, strict=True):
        where = f"{rid}: prompt of {len(prompt)}, budget {budget}"
        _assert_logprobs_match([lp for o in stream for lp in o.logprobs], ref, where)
        assert output_ids(stream) == ref.tokens, where
    assert_engine_idle(engine)


def test_prompt_logits_match_hf_exactly_enough(case: Case) -> None:
    """The full next-token distribution of a prompt, from the runner itself, against HF's."""
    engine = _engine(case.ckpt, max_num_batched_tokens=32)
    prompt, ref = case.prompts[2], case.refs[2]
    rid = engine.add_request(prompt_token_ids=prompt, params={"temperature": 0.0, "max_tokens": 1})
    logits = None
    while logits is None:  # chunked prefill: the last chunk gives the logits
        scheduled = engine.scheduler.schedule()
        inp = engine.runner.prepare(scheduled.chunks)
        step_logits = engine.runner.forward(inp)
        for chunk in scheduled.chunks:
            chunk.seq.num_computed_tokens += chunk.num_tokens
        if inp.sampling:
            logits = step_logits[0]
    engine.abort(rid)
    assert logits.shape == ref.logprobs[0].shape
    torch.testing.assert_close(torch.log_softmax(logits, -1), ref.logprobs[0], atol=ATOL, rtol=0)
    assert_engine_idle(engine)


def test_without_gemma2s_final_cap_the_logprobs_are_not_transformers() -> None:
    """Negative control of the final-logit soft-cap, which greedy tokens cannot show (tanh keeps
    the order): the same Gemma 2 checkpoint with the cap taken out of its config gives first
    logprobs away from transformers', with it within ATOL."""
    import copy
    import dataclasses

    ckpt = noisy_checkpoint("gemma2", **GEMMA2)
    prompt = list(range(100, 140))
    ref = _hf_greedy(_hf_model(ckpt), prompt, 1)
    uncapped = copy.deepcopy(ckpt.config)
    uncapped.final_logit_softcapping = None
    for config, close in ((ckpt.config, True), (uncapped, False)):
        engine = _engine(dataclasses.replace(ckpt, config=config))
        (stream,) = engine.generate_all([dict(prompt_token_ids=prompt,
                                              params=_params(1))]).values()
        step = stream[0].logprobs[0]
        gap = (torch.tensor([lp for _, lp in step.top]) - ref.logprobs[0].topk(TOP_N).values)
        assert (gap.abs().max() < ATOL) == close, gap
