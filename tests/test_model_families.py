"""The families past Llama's shape (kvserve/workers/model_executor/families.py: Qwen3's q/k
norms, Phi-3's fused checkpoint and long RoPE, Mistral's sliding window), each against
transformers' own model on the same random weights, through the engine's whole path: a
context of 300+ tokens (10 of Mistral's windows) prefilled in 16-token chunks, a prefix-cache
hit, preemption with swap to the host tier, bf16 by vLLM's rule; a negative control per family
feature; a directory saved by `save_pretrained` served by `kvserve generate --model DIR`; and
the refusal of architectures kvserve does not implement.
(tests/test_model_support.py runs every family, these included, through the short-prompt
checks; tests/test_tensor_parallel.py runs them at tp 2.)"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import pytest
import torch

from kvserve.bench.exactness import Greedy, compare, engine_greedy, hf_greedy
from kvserve.cli import main
from kvserve.workers.config import EngineConfig
from kvserve.workers.engine import LLMEngine
from kvserve.workers.errors import EngineConfigError
from kvserve.workers.model_executor.families import FAMILIES, family_of
from kvserve.workers.model_executor.loader import LoadedCheckpoint
from kvserve.workers.model_executor.tiny import tiny_config
from tests.helpers import assert_engine_idle, noisy_checkpoint
from tests.test_model_support import GEMMA2, GEMMA3, MIXTRAL

pytestmark = pytest.mark.usefixtures("one_torch_thread")

WINDOW = 32  # Mistral's sliding window here, in tokens
# long-RoPE with a trained length of 128: the 320-token context runs on the long factors
LONGROPE = {"rope_type": "longrope", "original_max_position_embeddings": 128, "factor": 8.0,
            "short_factor": [1.0 + 0.1 * i for i in range(8)],
            "long_factor": [2.0 + 0.5 * i for i in range(8)]}
# the families added past Llama/Qwen2/Mistral, with their checkpoints' settings
NEW_FAMILIES = {
    "qwen3": {},
    "phi3": {"original_max_position_embeddings": 128, "rope_parameters": LONGROPE},
    # a 32-token window, which the 320-token context is 10x; head dim 64, so that decode steps
    # run the CPU kernels' paged attention (64 and 128 only) with its window
    "mistral": {"sliding_window": WINDOW, "head_dim": 64},
    # local (32-token window) and global layers, soft-capped scores and logits (tests/
    # test_model_support.py: GEMMA2); head dim 64, for the CPU kernels' capped paged decode
    "gemma2": {**GEMMA2, "head_dim": 64},
    # local and global layers with a RoPE each (base 10,000; 1,000,000 scaled by 8) and q/k
    # norms (tests/test_model_support.py: GEMMA3)
    "gemma3_text": {**GEMMA3, "head_dim": 64},
    # 4 experts, 2 per token (tests/test_model_support.py: MIXTRAL)
    "mixtral": MIXTRAL,
}
NEW_TOKENS = 16
LONG = 320  # tokens: 20 blocks of 16, prefilled in 20 chunks


@dataclass
class Case:
    name: str
    ckpt: LoadedCheckpoint
    hf: Any
    prompts: dict[str, list[int]]
    refs: dict[str, Greedy]


@pytest.fixture(scope="module", params=list(NEW_FAMILIES))
def case(request) -> Case:
    from transformers import AutoModelForCausalLM

    ckpt = noisy_checkpoint(request.param, max_position_embeddings=1024,
                            **NEW_FAMILIES[request.param])
    hf = AutoModelForCausalLM.from_config(ckpt.config, dtype=torch.float32)
    hf.load_state_dict(ckpt.tensors)
    hf.eval()
    gen = torch.Generator().manual_seed(3)
    vocab = ckpt.config.vocab_size
    long = torch.randint(3, vocab, (LONG,), generator=gen).tolist()
    prompts = {
        "long": long,
        # its first 256 tokens (16 whole blocks) are the long prompt's: a prefix hit
        "shares_prefix": long[:256] + torch.randint(3, vocab, (40,), generator=gen).tolist(),
        **{f"p{n}": torch.randint(3, vocab, (n,), generator=gen).tolist() for n in (9, 70, 150)},
    }
    return Case(request.param, ckpt, hf, prompts, hf_greedy(hf, prompts, NEW_TOKENS))


def _engine(ckpt: LoadedCheckpoint, **config: Any) -> LLMEngine:
    config = {"device": "cpu", "kv_cache_memory": 8 * 1024**2, "max_num_batched_tokens": 16,
              **config}
    return LLMEngine(EngineConfig(**config), checkpoint=ckpt)


def _equal(ours: dict[str, Greedy], refs: dict[str, Greedy]) -> list[str]:
    """The prompts whose tokens differ from transformers' (top-k sets aside)."""
    return [name for name in ours if ours[name].tokens != refs[name].tokens]


def test_long_chunked_context_a_prefix_hit_and_swap_equal_transformers(case: Case) -> None:
    """fp32 greedy, token for token: the 320-token prompt in 16-token chunks, then a prompt
    sharing its first 256 tokens (served from the prefix cache), then everything at once in a
    pool so small that requests are preempted and swapped to the host tier and back."""
    engine = _engine(case.ckpt, enable_prefix_caching=True)
    first = engine_greedy(engine, {"long": case.prompts["long"]}, NEW_TOKENS, concurrent=False)
    hits_before = engine.kv_stats().prefix_hit_tokens
    rest = engine_greedy(engine, {k: v for k, v in case.prompts.items() if k != "long"},
                         NEW_TOKENS, concurrent=True)
    assert engine.kv_stats().prefix_hit_tokens - hits_before >= 256
    assert _equal({**first, **rest}, case.refs) == []
    assert_engine_idle(engine)

    # 30 blocks of 16 for five requests of up to 336 tokens: preemption, with swap. Mistral's
    # requests hold at most 4 blocks each (16-token chunks and the 32-token window): 8 blocks
    tight = _engine(case.ckpt, num_kv_blocks=8 if case.name == "mistral" else 30,
                    cpu_offload_memory=16 * 1024**2)
    ours = engine_greedy(tight, case.prompts, NEW_TOKENS, concurrent=True)
    stats = tight.kv_stats()
    assert stats.preemptions > 0 and stats.blocks_swapped_out > 0, stats
    assert _equal(ours, case.refs) == []
    assert_engine_idle(tight)


def test_bf16_is_close_to_transformers_bf16_by_vllms_rule(case: Case) -> None:
    hf = case.hf.to(torch.bfloat16)
    try:
        refs = hf_greedy(hf, case.prompts, NEW_TOKENS)
    finally:
        case.hf.to(torch.float32)
    ours = engine_greedy(_engine(case.ckpt, dtype="bfloat16"), case.prompts, NEW_TOKENS,
                         concurrent=True)
    results = compare(ours, refs)
    assert all(c.close for c in results), results


def _without_its_feature(case: Case) -> LLMEngine:
    """An engine on the case's checkpoint with the family's own feature removed: Qwen3's q/k
    norms; Phi-3's long-RoPE scaling (plain RoPE instead); Mistral's window (full attention,
    every block kept); Gemma 2's attention soft-cap; Gemma 3's RoPE per layer type (the local
    one on every layer); Mixtral's second expert per token."""
    if case.name == "phi3":
        assert case.ckpt.config.rope_parameters["rope_type"] == "longrope"
        return _engine(case.ckpt, rope_parameters={"rope_type": "default"})
    engine = _engine(case.ckpt)
    attns = [layer.self_attn for layer in engine.runner.model.layers]
    if case.name == "qwen3":
        assert all(a.q_norm is not None for a in attns)
        for a in attns:
            a.q_norm = a.k_norm = None
        return engine
    if case.name == "mistral":
        assert [a.window for a in attns] == [WINDOW, WINDOW]
        assert engine.block_manager.sliding_window == WINDOW
        for a in attns:
            a.window = 0
        engine.block_manager.sliding_window = None
        return engine
    if case.name == "gemma2":
        assert [a.softcap for a in attns] == [GEMMA2["attn_logit_softcapping"]] * 2
        assert [a.window for a in attns] == [WINDOW, 0]  # local, then global
        for a in attns:
            a.softcap = 0.0
        return engine
    if case.name == "gemma3_text":
        assert [a.rope_part for a in attns] == [1, 0]  # local, global: rope_kinds is sorted
        for a in attns:
            a.rope_part = 1  # the local layer's RoPE on both
        return engine
    if case.name == "mixtral":
        moes = [layer.mlp for layer in engine.runner.model.layers]
        assert all(m.top_k == 2 for m in moes)
        for m in moes:
            m.top_k = 1  # the router's first choice alone
        return engine
    raise AssertionError(f"no switch for {case.name}")


def test_without_the_familys_feature_the_output_is_not_transformers(case: Case) -> None:
    """Negative control: the same checkpoint with the family's feature switched off (Qwen3:
    the q/k norms; Phi-3: long RoPE; Mistral: the window; Gemma 2: the attention soft-cap;
    Gemma 3: its global layer's own RoPE; Mixtral: each token's second expert) departs from
    transformers on every prompt
    (Mistral's: on every prompt longer than its window; within it, full attention is the same
    attention)."""
    ours = engine_greedy(_without_its_feature(case), case.prompts, NEW_TOKENS, concurrent=True)
    affected = [name for name, ids in case.prompts.items()
                if case.name != "mistral" or len(ids) + NEW_TOKENS > WINDOW]
    assert len(affected) >= 4
    assert sorted(_equal(ours, case.refs)) == sorted(affected)


@pytest.mark.slow
def test_a_save_pretrained_directory_serves_through_kvserve_generate(case: Case, tmp_path,
                                                                     capsys) -> None:
    """transformers' own layout (config.json, model.safetensors with its tensor names and tied
    embeddings, tokenizer files) through `kvserve generate --model DIR`: transformers' tokens."""
    model_dir = tmp_path / case.name
    case.hf.save_pretrained(model_dir)
    case.ckpt.tokenizer.save_pretrained(model_dir)
    text = "The capital of France is a city that"
    ids = case.ckpt.tokenizer(text)["input_ids"]
    ref = hf_greedy(case.hf, {"p": ids}, 8)["p"].tokens
    assert main(["generate", "--model", str(model_dir), "--device", "cpu", "--max-tokens", "8",
                 "--json", text]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["token_ids"] == ref


def test_an_unimplemented_architecture_is_refused_naming_model_type(tmp_path, capsys) -> None:
    """An OLMo 2 checkpoint (Llama's tensor names, and q/k norms over whole projections, which
    Qwen3's per-head norms would misread) is refused before anything runs: the error names the
    field, its model_type and the supported list; the CLI prints it in one line and exits 2."""
    from transformers import AutoModelForCausalLM

    config = tiny_config("olmo2", head_dim=16)
    with pytest.raises(EngineConfigError) as refused:
        family_of(config)
    assert refused.value.field == "model"
    assert "'olmo2'" in str(refused.value)
    assert f"supported: {', '.join(FAMILIES)}" in str(refused.value)
    model_dir = tmp_path / "olmo2"
    AutoModelForCausalLM.from_config(config).save_pretrained(model_dir)
    (model_dir / "tokenizer_config.json").write_text("{}")  # never read: refused first
    capsys.readouterr()
    assert main(["generate", "--model", str(model_dir), "--device", "cpu", "Hi"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "'olmo2'" in err and "gemma2" in err


def test_kvserve_models_lists_the_families(capsys) -> None:
    assert main(["models"]) == 0
    text = capsys.readouterr().out
    for family in FAMILIES.values():
        assert family.model_type in text and family.name in text
    assert main(["models", "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert listed == [f.to_dict() for f in FAMILIES.values()]


def test_each_family_s_checkpoint_has_its_own_tensors() -> None:
    """Guards the tests above against a vacuous setup: the family's tensors exist and are not
    their initial values (noisy_checkpoint perturbs norms), and each feature flag is set."""
    ckpt = noisy_checkpoint("qwen3")
    q_norm = ckpt.tensors["model.layers.0.self_attn.q_norm.weight"]
    assert q_norm.shape == (16,) and (q_norm - 1).abs().max() > 0.05
    assert FAMILIES["qwen3"].qk_norm and not FAMILIES["llama"].qk_norm
    phi3 = noisy_checkpoint("phi3", **NEW_FAMILIES["phi3"])
    assert {"model.layers.0.self_attn.qkv_proj.weight",
            "model.layers.0.mlp.gate_up_proj.weight"} <= phi3.tensors.keys()
    assert "model.layers.0.self_attn.q_proj.weight" not in phi3.tensors
    assert phi3.config.rope_parameters["original_max_position_embeddings"] == 128 < LONG


@pytest.mark.triton
def test_the_triton_backend_gives_transformers_tokens(case: Case) -> None:
    """The GPU path (Triton attention, the fused RoPE + KV write after the family's own ops),
    in fp32 on short prompts: transformers' tokens. On CUDA when there is one (the device
    check's gpu_tests section), else under Triton's interpreter."""
    pytest.importorskip("triton")
    if case.name == "phi3":
        pytest.skip("Phi-3's differences (fused weights, long RoPE's cos/sin) are upstream of "
                    "the attention backend; Qwen3's q/k norms run right before its fused kernel")
    prompts = {k: case.prompts[k] for k in ("p9", "p70")}
    device = "cuda" if torch.cuda.is_available() else "cpu"
    engine = _engine(case.ckpt, attention_backend="triton", device=device, dtype="float32")
    ours = engine_greedy(engine, prompts, 8, concurrent=True)
    assert _equal(ours, hf_greedy(case.hf, prompts, 8)) == []


def test_a_mixture_of_experts_under_tensor_parallelism_is_refused_naming_the_field() -> None:
    """Mixtral's experts are not split over ranks yet: tp 2 is refused before any rank starts,
    on the `tensor_parallel_size` field, naming the model type; tp 1 is taken."""
    from kvserve.workers.parallel.shard import check_divisible

    config = tiny_config("mixtral", **MIXTRAL)
    check_divisible(config, 1)
    with pytest.raises(EngineConfigError) as refused:
        check_divisible(config, 2)
    assert refused.value.field == "tensor_parallel_size"
    assert "'mixtral'" in str(refused.value) and "kvserve models" in str(refused.value)


def test_the_tiny_checkpoint_writer_makes_a_directory_kvserve_serves(tmp_path, capsys) -> None:
    """`python -m kvserve.workers.model_executor.tiny` (the benchmarks' tiny Mixtral): its
    FIELD=VALUE overrides reach the config, and `kvserve generate --model DIR` serves it."""
    from kvserve.workers.model_executor import tiny

    out = tmp_path / "mixtral"
    assert tiny.main(["mixtral", str(out), "num_local_experts=4", "num_experts_per_tok=2",
                      "hidden_act=silu"]) == 0
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "mixtral" and config["num_local_experts"] == 4
    capsys.readouterr()
    assert main(["generate", "--model", str(out), "--device", "cpu", "--max-tokens", "4",
                 "--json", "Hello"]) == 0
    assert len(json.loads(capsys.readouterr().out)["token_ids"]) == 4
    with pytest.raises(SystemExit):
        tiny.main(["mixtral", str(out), "num_local_experts"])  # not FIELD=VALUE
