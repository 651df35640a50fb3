"""The Hugging Face baselines of `kvserve bench throughput` and the GPU check: every request
runs, emits `output_len` tokens, and computes what plain greedy `model.generate()` does."""

from __future__ import annotations

import types

import pytest
import torch

from kvserve.bench import baselines
from kvserve.bench.common import make_prompts

OUTPUT_LEN = 6


@pytest.fixture(scope="module")
def tiny_hf():
    """A random 2-layer Llama in fp32 with SDPA, as `gpu_check.random_model` builds (in bf16
    there): fp32 so that every way of batching picks the same greedy tokens."""
    from transformers import AutoModelForCausalLM

    from kvserve.workers.model_executor.tiny import tiny_config

    config = tiny_config("llama")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32,
                                             attn_implementation="sdpa")
    return model.eval()


@pytest.fixture(scope="module")
def prompts(tiny_hf) -> list[list[int]]:
    """Four prompts of different lengths (the padded baseline pads them)."""
    full = make_prompts(tiny_hf.config.vocab_size, 4, 24)
    return [p[: 24 - 5 * i] for i, p in enumerate(full)]


@pytest.fixture(scope="module")
def plain_greedy(tiny_hf, prompts) -> list[list[int]]:
    """Plain `model.generate()`, one prompt at a time, greedy, no option of ours."""
    tokens = []
    with torch.no_grad():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            out = tiny_hf.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                                   do_sample=False, max_new_tokens=OUTPUT_LEN, pad_token_id=0)
            tokens.append(out[0, len(prompt):].tolist())
    assert all(len(t) == OUTPUT_LEN for t in tokens)  # no EOS on the way, or the test is moot
    return tokens


def test_generate_batch_runs_every_request_and_equals_greedy_generate(tiny_hf, prompts,
                                                                      plain_greedy):
    result = baselines.hf_generate_batch(tiny_hf, prompts, OUTPUT_LEN)
    assert result.output_tokens == len(prompts) * OUTPUT_LEN
    assert result.tokens == plain_greedy
    assert tiny_hf.config._attn_implementation == "sdpa"  # "paged|sdpa" undone afterwards


def test_generate_batch_never_runs_in_the_callers_inference_mode(tiny_hf, prompts,
                                                                 monkeypatch):
    """transformers 5.17's generation thread runs without inference mode (5.24 hands it the
    caller's): the manager's tensors, made in the calling thread, must not be inference tensors
    or the thread fails every request ("Inplace update to inference tensor outside
    InferenceMode"). 5.25 would hide that, so the mode is checked here directly."""
    modes = []
    real = tiny_hf.generate_batch

    def spy(*args, **kwargs):
        modes.append(torch.is_inference_mode_enabled())
        return real(*args, **kwargs)

    monkeypatch.setattr(tiny_hf, "generate_batch", spy)
    with torch.inference_mode():
        result = baselines.hf_generate_batch(tiny_hf, prompts[:2], 2)
    assert modes == [False, False]  # the warm-up call and the timed one
    assert result.output_tokens == 4


def test_a_failed_generate_batch_request_raises_with_its_reason(tiny_hf, prompts, monkeypatch):
    """Negative control: a paged cache of one 16-token page holds no 24-token prompt, so
    transformers fails the requests; the error must say so, for every one of them."""
    from transformers import ContinuousBatchingConfig

    def one_page(*_args):
        fields = ContinuousBatchingConfig.__dataclass_fields__
        page = "page_size" if "page_size" in fields else "block_size"  # 5.17: block_size
        return ContinuousBatchingConfig(**{page: 16, "num_blocks": 1, "max_batch_tokens": 256})

    monkeypatch.setattr(baselines, "cb_config_for", one_page)
    with pytest.raises(RuntimeError) as caught:
        baselines.hf_generate_batch(tiny_hf, prompts[:1], OUTPUT_LEN)
    message = str(caught.value)
    assert "(the timed call) returned 1/1 results" in message
    assert "No requests can be scheduled" in message


def test_short_or_missing_generate_batch_results_raise():
    """A request cut short, or one missing, fails the run as an error would."""
    def out(tokens, prompt, error=None):
        return types.SimpleNamespace(generated_tokens=tokens, prompt_ids=prompt, error=error)

    prompts = [[5, 6], [7, 8]]
    good = {"req_0": out([1, 2], [5, 6]), "req_1": out([3, 4], [7, 8])}
    assert baselines._check_batch_outputs(good, prompts, 2, "t") == [[1, 2], [3, 4]]
    with pytest.raises(RuntimeError, match="req_1: 1 tokens, not 2"):
        baselines._check_batch_outputs({**good, "req_1": out([3], [7, 8])}, prompts, 2, "t")
    with pytest.raises(RuntimeError, match=r"returned 1/2 results"):
        baselines._check_batch_outputs({"req_0": good["req_0"]}, prompts, 2, "t")
    with pytest.raises(RuntimeError, match="req_0: prompt is not request 0's"):
        baselines._check_batch_outputs({"req_0": good["req_1"], "req_1": good["req_0"]},
                                       prompts, 2, "t")


def test_sequential_and_padded_generate_equal_plain_greedy(tiny_hf, prompts, plain_greedy):
    sequential = baselines.hf_generate_sequential(tiny_hf, prompts, OUTPUT_LEN)
    assert sequential.tokens == plain_greedy
    padded = baselines.hf_generate_padded(tiny_hf, prompts, OUTPUT_LEN, batch_size=3)
    assert padded.tokens == plain_greedy  # left padding, masked: the same tokens in fp32
    assert sequential.output_tokens == padded.output_tokens == len(prompts) * OUTPUT_LEN
