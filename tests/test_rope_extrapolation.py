"""Every RoPE variant past the trained length, on the real weights, equals transformers.

SmolLM2 is trained to 8,192 tokens; proving extrapolation there would need 10k+ token prompts,
too slow for CI. So both sides get the real weights with `max_position_embeddings` shortened to
256: a 512-token passkey prompt is then twice the "trained" length, every variant's
length-dependent branch is taken (dynamic NTK's grown base, longrope's long factors, yarn's and
llama3's original length), and transformers' `generate()` stays a few seconds.

The engine prefills the prompt in four 128-token chunks, as a serving engine does; transformers
runs it as one forward call. Greedy tokens must be equal (a difference only at a proven near-tie,
where the reference's top two logprobs are within `NEAR_TIE`), and the logprobs close.

Negative control: with kvserve/workers/model_executor/rope.py rotating each chunk's prompt tokens
for the length the prompt had reached, instead of the whole prompt's length, dynamic:2 and
longrope:2 fail here (dynamic NTK's first chunks keep the unscaled base).
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

import pytest
import torch

from kvserve.evals.recall_tasks import build_sample
from kvserve.evals.rope_variants import parse_rope_variant
from kvserve.workers.config import EngineConfig
from kvserve.workers.engine import LLMEngine
from kvserve.workers.model_executor.loader import LoadedCheckpoint, override_rope
from tests.helpers import assert_engine_idle, output_ids

SHORT_TRAINED = 256
PROMPT_LEN = 512
CHUNK = 128
NEW_TOKENS = 8
NEAR_TIE = 1e-4  # nats between the reference's top two logprobs
VARIANTS = ["none", "linear:2", "dynamic:2", "yarn:2", "llama3:2", "longrope:2"]


@pytest.fixture(scope="module")
def short_trained(real_checkpoint: LoadedCheckpoint) -> LoadedCheckpoint:
    """The real weights and tokenizer with a config that says the model was trained to 256."""
    config = copy.deepcopy(real_checkpoint.config)
    config.max_position_embeddings = SHORT_TRAINED
    return dataclasses.replace(real_checkpoint, config=config)


@pytest.fixture(scope="module")
def prompt_ids(short_trained: LoadedCheckpoint) -> list[int]:
    sample = build_sample("passkey", short_trained.tokenizer, PROMPT_LEN, 50, index=0, seed=0)
    ids = short_trained.tokenizer(sample.prompt)["input_ids"]
    assert len(ids) == sample.prompt_tokens  # 512 here: within 1 % of the asked length
    assert 3 * CHUNK < len(ids) <= 4 * CHUNK and len(ids) > SHORT_TRAINED
    return ids


@pytest.fixture(scope="module")
def hf_short(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, max_position_embeddings=SHORT_TRAINED).eval()


@dataclasses.dataclass
class Reference:
    tokens: list[int]
    logprobs: torch.Tensor  # [NEW_TOKENS, vocab] fp32


@pytest.fixture(scope="module")
def references(hf_short, short_trained: LoadedCheckpoint, prompt_ids: list[int]):
    """transformers' greedy continuation per variant, computed once (`none` is also the
    baseline the other variants must differ from)."""
    cache: dict[str, Reference] = {}

    def reference(variant: str) -> Reference:
        if variant not in cache:
            cache[variant] = _hf_generate(hf_short, short_trained, _rope(variant), prompt_ids)
        return cache[variant]

    return reference


def _rope(variant: str) -> dict[str, Any] | None:
    return parse_rope_variant(variant).rope_parameters


def _hf_generate(hf, ckpt: LoadedCheckpoint, rope: dict[str, Any] | None,
                 prompt: list[int]) -> Reference:
    config = copy.deepcopy(hf.config)
    if rope:
        config.rope_parameters = override_rope(ckpt.config, rope)
    # a fresh rotary module with the variant's parameters (dynamic ones keep state across calls)
    hf.model.rotary_emb = type(hf.model.rotary_emb)(config=config)
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        out = hf.generate(
            ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=NEW_TOKENS,
            min_new_tokens=NEW_TOKENS, return_dict_in_generate=True, output_logits=True,
            pad_token_id=0,
        )
    logprobs = torch.log_softmax(torch.cat(out.logits).float(), dim=-1)
    return Reference(out.sequences[0, len(prompt):].tolist(), logprobs)


@pytest.mark.parametrize("variant", VARIANTS)
def test_chunked_prompt_past_the_trained_length_matches_transformers(
    variant: str, short_trained: LoadedCheckpoint, prompt_ids: list[int], references,
) -> None:
    ref = references(variant)
    if variant != "none":  # the variant changed the model's answer distribution
        gap = (ref.logprobs[0] - references("none").logprobs[0]).abs().max()
        assert gap > 1e-2, f"{variant} computes what plain RoPE does"

    config = EngineConfig(
        rope_parameters=_rope(variant), max_model_len=PROMPT_LEN + NEW_TOKENS,
        max_num_batched_tokens=CHUNK, kv_cache_memory=128 * 1024**2, device="cpu",
    )
    engine = LLMEngine(config, checkpoint=short_trained)
    params = {"temperature": 0.0, "max_tokens": NEW_TOKENS, "ignore_eos": True, "logprobs": 1}
    engine.add_request(prompt_token_ids=prompt_ids, params=params)
    steps = [engine.step() for _ in range(PROMPT_LEN // CHUNK)]
    assert [len(s) for s in steps] == [0, 0, 0, 1], "the prompt was not prefilled in 4 chunks"
    stream = [out for s in steps for out in s] + list(engine.run_until_done())
    got = output_ids(stream)

    agree = next((i for i, (a, b) in enumerate(zip(got, ref.tokens, strict=True)) if a != b),
                 NEW_TOKENS)
    if agree < NEW_TOKENS:
        top2 = ref.logprobs[agree].topk(2).values
        gap = float(top2[0] - top2[1])
        assert gap < NEAR_TIE, (
            f"{variant}: first difference at step {agree}: engine {got[agree]}, transformers "
            f"{ref.tokens[agree]}, reference top-2 gap {gap:.2e} (not a near-tie)")
    engine_lp = torch.tensor([s.logprob for o in stream for s in o.logprobs][:agree])
    torch.testing.assert_close(engine_lp, ref.logprobs[torch.arange(agree), got[:agree]],
                               atol=1e-3, rtol=0)
    assert_engine_idle(engine)
