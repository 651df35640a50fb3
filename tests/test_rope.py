"""RoPE overrides reach the engine's model, and match transformers' rotary embedding exactly.

The reference is the rotary module of `AutoModelForCausalLM.from_config(config)` built from the
same config: a fresh instance for each call, because dynamic NTK's module is stateful (it keeps the
longest sequence length it has seen). cos/sin are compared with torch.equal: both sides evaluate
`cos(position * inv_freq) * attention_scaling` elementwise in fp32 from the same `inv_freq` (each
entry is a single product, so gathering rows of a precomputed table cannot change a bit).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest
import torch

from kvserve.evals.rope_variants import parse_rope_variant
from kvserve.workers.config import EngineConfig
from kvserve.workers.engine import LLMEngine
from kvserve.workers.model_executor.loader import LoadedCheckpoint
from kvserve.workers.model_executor.rope import RopeSpan
from kvserve.workers.model_executor.tiny import tiny_checkpoint, tiny_config
from tests.helpers import assert_engine_idle, output_ids

pytestmark = pytest.mark.usefixtures("one_torch_thread")

TRAINED_LEN = 512  # tiny_config's max_position_embeddings
MAX_MODEL_LEN = 1024
# as `kvserve eval recall --rope ...` builds them (kvserve/evals/rope_variants.py)
VARIANTS: dict[str, dict[str, Any]] = {
    "none": {"rope_type": "none"},
    "linear": parse_rope_variant("linear:2").rope_parameters,
    "dynamic": parse_rope_variant("dynamic:2").rope_parameters,
    "yarn": parse_rope_variant(f"yarn:4,original_max_position_embeddings={TRAINED_LEN}")
    .rope_parameters,
    "llama3": parse_rope_variant("llama3:8,original_max_position_embeddings=256").rope_parameters,
    "longrope": parse_rope_variant("longrope:2").rope_parameters,
}
POSITIONS = [0, 1, 2, 15, 16, 100, 255, 256, 257, 511, 512, 513, 600, 777, 1023]


@dataclass
class Setup:
    name: str
    ckpt: LoadedCheckpoint
    engine: LLMEngine
    hf: torch.nn.Module




def _engine(ckpt: LoadedCheckpoint, rope: dict[str, Any] | None, chunk: int = MAX_MODEL_LEN,
            **config: Any) -> LLMEngine:
    config = EngineConfig(
        rope_parameters=rope, max_model_len=MAX_MODEL_LEN, max_num_batched_tokens=chunk,
        device="cpu", **({"kv_cache_memory": 4 * 1024**2} | config),
    )
    return LLMEngine(config, checkpoint=ckpt)


@pytest.fixture(scope="module", params=list(VARIANTS))
def setup(request: pytest.FixtureRequest) -> Setup:
    from transformers import AutoModelForCausalLM

    rope = VARIANTS[request.param]
    # the HF reference is built from the checkpoint's config, so it carries the override too
    ckpt = tiny_checkpoint("llama", rope_parameters=rope, initializer_range=0.1)
    hf = AutoModelForCausalLM.from_config(ckpt.config, dtype=torch.float32)
    hf.load_state_dict(ckpt.tensors)
    return Setup(request.param, ckpt, _engine(ckpt, rope), hf.eval())


def _hf_cos_sin(config: Any, positions: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' rotary embedding on a fresh module of the model built from `config`."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        rotary_cls = type(AutoModelForCausalLM.from_config(config).model.rotary_emb)
    module = rotary_cls(config=config)
    probe = torch.zeros(1, len(positions), 16, dtype=torch.float32)
    cos, sin = module(probe, torch.tensor([positions]))
    return cos[0], sin[0]


def _default_cos_sin(positions: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    return _hf_cos_sin(tiny_config("llama"), positions)


def test_override_reaches_the_engine(setup: Setup) -> None:
    want = dict(VARIANTS[setup.name])
    if want["rope_type"] == "none":
        want["rope_type"] = "default"
    got = setup.engine.info.rope_parameters
    assert {k: got.get(k) for k in want} == want
    assert setup.engine.runner.rope.rope_type == want["rope_type"]
    assert setup.engine.max_model_len == MAX_MODEL_LEN


def test_cos_sin_equal_hf(setup: Setup) -> None:
    """One chunk of scattered positions up to max_model_len - 1, past the trained length."""
    # as one forward call over a 1024-token sequence: transformers' length is max(position) + 1
    span = RopeSpan(start=0, num_tokens=len(POSITIONS), prompt_len=MAX_MODEL_LEN)
    cos, sin = setup.engine.runner.rope.lookup(torch.tensor(POSITIONS), [span])
    ref_cos, ref_sin = _hf_cos_sin(setup.ckpt.config, POSITIONS)
    assert cos.shape == ref_cos.shape == (len(POSITIONS), 16)
    assert torch.equal(cos, ref_cos)
    assert torch.equal(sin, ref_sin)
    default_cos, default_sin = _default_cos_sin(POSITIONS)
    if setup.name == "none":
        assert torch.equal(cos, default_cos) and torch.equal(sin, default_sin)
    else:  # the override changed the rotation, so this test could tell variants apart
        assert (cos - default_cos).abs().max() > 1e-2


def test_cos_sin_per_chunk_equal_hf(setup: Setup) -> None:
    """Two sequences in one step: a short prefill and the last chunk (600..700) of a 701-token
    prompt.

    Dynamic NTK rotates every prompt token with the base for the prompt's length, as
    transformers does for the whole prompt at once; a batch neighbour must not change it.
    """
    short, long_tail = list(range(10)), list(range(600, 701))
    positions = torch.tensor(short + long_tail)
    spans = [RopeSpan(0, len(short), len(short)), RopeSpan(600, len(long_tail), 701)]
    cos, sin = setup.engine.runner.rope.lookup(positions, spans)
    ref_cos_short, ref_sin_short = _hf_cos_sin(setup.ckpt.config, short)
    ref_cos_long, ref_sin_long = _hf_cos_sin(setup.ckpt.config, list(range(701)))
    assert torch.equal(cos[:10], ref_cos_short) and torch.equal(sin[:10], ref_sin_short)
    assert torch.equal(cos[10:], ref_cos_long[600:]) and torch.equal(sin[10:], ref_sin_long[600:])
    if setup.name == "dynamic":
        # within the trained length dynamic NTK is plain RoPE; past it, the base grows
        default_cos, _ = _default_cos_sin(short + long_tail)
        assert torch.equal(cos[:10], default_cos[:10])
        assert (cos[10:] - default_cos[10:]).abs().max() > 1e-2
        # ...and with the length reached: the same positions of a 1024-token sequence differ
        other_cos, _ = _hf_cos_sin(setup.ckpt.config, list(range(MAX_MODEL_LEN)))
        assert (cos[10:] - other_cos[600:701]).abs().max() > 1e-4


def test_decoded_and_recomputed_tokens_rotate_as_transformers_decodes(setup: Setup) -> None:
    """A 700-token prompt and 5 decoded tokens, recomputed in one chunk after a preemption:
    prompt tokens keep the prompt's length, each later token the length it reached, as in
    transformers' `generate()` (one forward over the prompt, then one per token)."""
    prompt_len, total = 700, 705
    cos, sin = setup.engine.runner.rope.lookup(torch.arange(total),
                                               [RopeSpan(0, total, prompt_len)])
    ref_cos, ref_sin = _hf_cos_sin(setup.ckpt.config, list(range(prompt_len)))
    assert torch.equal(cos[:prompt_len], ref_cos) and torch.equal(sin[:prompt_len], ref_sin)
    for p in range(prompt_len, total):  # a decode step's forward ends at p
        step_cos, step_sin = _hf_cos_sin(setup.ckpt.config, list(range(p + 1)))
        assert torch.equal(cos[p], step_cos[p]) and torch.equal(sin[p], step_sin[p])


def test_cache_key_names_what_a_long_prompt_rotation_depends_on(setup: Setup) -> None:
    rope = setup.engine.runner.rope
    assert rope.cache_key(TRAINED_LEN) == ""  # within the trained length: plain RoPE's keys
    want = {"dynamic": f"rope:{TRAINED_LEN + 1}", "longrope": "rope:long"}.get(setup.name, "")
    assert rope.cache_key(TRAINED_LEN + 1) == want


@pytest.mark.parametrize("name", ["linear", "dynamic", "yarn", "longrope"])
def test_greedy_past_trained_length_matches_hf(name: str) -> None:
    """A 600-token prompt (trained length 512) prefilled in 128-token chunks, and 8 greedy
    tokens, engine vs HF generate (whose prompt is one forward call)."""
    from transformers import AutoModelForCausalLM

    rope = VARIANTS[name]
    ckpt = tiny_checkpoint("llama", rope_parameters=rope, initializer_range=0.1)
    hf = AutoModelForCausalLM.from_config(ckpt.config, dtype=torch.float32)
    hf.load_state_dict(ckpt.tensors)
    gen = torch.Generator().manual_seed(3)
    prompt = torch.randint(3, ckpt.config.vocab_size, (600,), generator=gen)
    n = 8
    ids = prompt[None]
    with torch.inference_mode():
        ref = hf.eval().generate(
            ids, attention_mask=torch.ones_like(ids), do_sample=False, min_new_tokens=n,
            max_new_tokens=n, return_dict_in_generate=True, output_logits=True, pad_token_id=0,
        )
    want = ref.sequences[0, 600:].tolist()
    ref_logprobs = torch.log_softmax(torch.cat(ref.logits).float(), dim=-1)
    assert ckpt.tokenizer.eos_token_id not in want  # HF masks eos (min_new_tokens), engine not

    engine = _engine(ckpt, rope, chunk=128)  # five chunks, as a serving engine splits it
    params = {"temperature": 0.0, "max_tokens": n, "ignore_eos": True, "logprobs": 2}
    out = engine.generate_all([dict(prompt_token_ids=prompt.tolist(), params=params)])
    (stream,) = out.values()
    got = output_ids(stream)
    if got != want:
        step = next(i for i, (a, b) in enumerate(zip(got, want, strict=True)) if a != b)
        top2 = ref_logprobs[step].topk(2).values
        gap = float(top2[0] - top2[1])
        pytest.fail(f"{name}: first difference at step {step}: engine {got[step]}, HF "
                    f"{want[step]}; HF top-2 logprob gap {gap:.2e} (near-tie if < 1e-4)")
    steps = [lp for o in stream for lp in o.logprobs]
    engine_lp = torch.tensor([s.logprob for s in steps])
    torch.testing.assert_close(engine_lp, ref_logprobs[torch.arange(n), want], atol=1e-4, rtol=0)
    assert_engine_idle(engine)


def test_engine_config_override_applies_to_a_given_checkpoint() -> None:
    engine = _engine(tiny_checkpoint("llama"), VARIANTS["linear"])
    assert engine.info.rope_parameters["rope_type"] == "linear"
    positions = torch.tensor(POSITIONS)
    cos, _ = engine.runner.rope.lookup(positions, [RopeSpan(0, len(POSITIONS), MAX_MODEL_LEN)])
    assert not torch.equal(cos, _default_cos_sin(POSITIONS)[0])


def test_rope_variant_specs_parse_and_reject_clearly() -> None:
    assert parse_rope_variant("none").rope_parameters is None
    assert parse_rope_variant("yarn:2,beta_fast=32").rope_parameters == {
        "rope_type": "yarn", "factor": 2.0, "beta_fast": 32.0}
    assert parse_rope_variant("llama3:8").rope_parameters["high_freq_factor"] == 4.0
    for bad in ("ntk:2", "linear", "linear:x", "yarn:2,beta", "linear:0.5"):
        with pytest.raises(ValueError, match="--rope"):
            parse_rope_variant(bad)


def test_dynamic_output_ignores_chunking_preemption_and_neighbours() -> None:
    """Three 560-token prompts past the trained length, 48 greedy tokens each, in 64-token
    chunks on a pool too small for all three (preempted, then recomputed), equal one-chunk solo
    runs: dynamic NTK's rotation depends on the request alone."""
    rope = VARIANTS["dynamic"]
    ckpt = tiny_checkpoint("llama", rope_parameters=rope, initializer_range=0.1)
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, ckpt.config.vocab_size, (560,), generator=gen).tolist()
               for _ in range(3)]
    params = {"temperature": 0.0, "max_tokens": 48, "ignore_eos": True}
    solo = _engine(ckpt, rope)
    want = [output_ids(next(iter(solo.generate_all(
        [dict(prompt_token_ids=p, params=params)]).values()))) for p in prompts]
    pressed = _engine(ckpt, rope, chunk=64, num_kv_blocks=90, block_size=16)
    out = pressed.generate_all([dict(prompt_token_ids=p, params=params, request_id=str(i))
                                for i, p in enumerate(prompts)])
    assert pressed.kv_stats().preemptions > 0, "the pool was not under pressure"
    assert [output_ids(out[str(i)]) for i in range(3)] == want
    assert_engine_idle(pressed)
