"""FlashAttention-2 backend against the torch backend (CUDA only; skipped elsewhere)."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from tests.helpers import assert_engine_idle, output_ids
from workers.config import EngineConfig
from workers.engine import LLMEngine

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.skipif(importlib.util.find_spec("flash_attn") is None,
                       reason="needs flash-attn (the gpu extra)"),
]


def _engine(backend: str) -> LLMEngine:
    # float16 keeps both backends on the same dtype; block 256 is what flash-attn pages need
    return LLMEngine(EngineConfig(device="cuda", dtype="float16", attention_backend=backend,
                                  block_size=256, kv_cache_memory=2 * 1024**3,
                                  max_num_batched_tokens=256))


def test_auto_picks_flash_attn_on_cuda():
    assert LLMEngine(EngineConfig(device="cuda")).info.attention_backend == "flash_attn"


def test_flash_matches_torch_backend_logprobs_and_tokens():
    prompts = [list(range(100, 100 + n)) for n in (5, 300, 700)]  # one spans chunks and pages
    params = {"temperature": 0, "max_tokens": 24, "logprobs": 1, "ignore_eos": True}
    results = {}
    for backend in ("torch", "flash_attn"):
        engine = _engine(backend)
        out = engine.generate_all([{"prompt_token_ids": p, "params": params} for p in prompts])
        results[backend] = list(out.values())
        assert_engine_idle(engine)
    for torch_outs, flash_outs in zip(results["torch"], results["flash_attn"], strict=True):
        a = torch.tensor([lp.logprob for o in torch_outs for lp in o.logprobs])
        b = torch.tensor([lp.logprob for o in flash_outs for lp in o.logprobs])
        # the first tokens agree exactly; later ones may part at fp16 near-ties only
        assert output_ids(torch_outs)[:4] == output_ids(flash_outs)[:4]
        torch.testing.assert_close(a[:4], b[:4], atol=2e-2, rtol=0)
