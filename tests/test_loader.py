"""Model resolution: the shipped GGUF is converted once to fp32 safetensors, then reused."""

from __future__ import annotations

import json

from kvserve.workers.model_executor.loader import (
    DEFAULT_MODEL,
    LoadedCheckpoint,
    load_checkpoint,
    resolve_model_dir,
    with_rope_override,
)


def test_default_model_is_converted_once_and_cached(model_dir):
    assert model_dir.name == DEFAULT_MODEL
    assert (model_dir / "model.safetensors").exists()
    config = json.loads((model_dir / "config.json").read_text())
    assert "quantization_config" not in config  # plain fp32 weights now
    assert (config["num_hidden_layers"], config["hidden_size"]) == (30, 576)
    assert (config["num_attention_heads"], config["num_key_value_heads"]) == (9, 3)
    mtime = (model_dir / "model.safetensors").stat().st_mtime
    assert resolve_model_dir(None) == model_dir
    assert (model_dir / "model.safetensors").stat().st_mtime == mtime  # not converted again


def test_a_local_hf_directory_loads_as_is(model_dir):
    ckpt = load_checkpoint(str(model_dir))
    assert ckpt.path == model_dir
    assert ckpt.config.tie_word_embeddings
    assert ckpt.tensors["model.embed_tokens.weight"].shape == (49152, 576)
    assert ckpt.tokenizer.eos_token == "<|im_end|>"


def test_engines_built_from_one_checkpoint_share_its_model_and_only_theirs():
    """Engines built from one LoadedCheckpoint in one process share one model (its fused and
    packed weights made once); a checkpoint derived with other tensors (`dataclasses.replace`)
    or another dtype gets a model of its own, and each engine's outputs stay its own."""
    import dataclasses

    import torch

    from kvserve.workers.config import EngineConfig
    from kvserve.workers.engine import LLMEngine
    from kvserve.workers.model_executor.tiny import (
        synthetic_tokenizer,
        tiny_checkpoint,
        tiny_config,
    )

    cfg = tiny_config("llama")
    tok = synthetic_tokenizer(cfg.vocab_size, cfg.bos_token_id, cfg.eos_token_id)
    ckpt = tiny_checkpoint("llama", seed=0, tokenizer=tok)
    other = dataclasses.replace(ckpt, tensors=tiny_checkpoint("llama", seed=1,
                                                              tokenizer=tok).tensors)

    def engine(c, dtype="float32"):
        return LLMEngine(EngineConfig(device="cpu", dtype=dtype, kv_cache_memory=4 * 1024**2),
                         checkpoint=c)

    def greedy(e):
        outs = e.generate_all([{"prompt_token_ids": [1, 5, 9, 13], "request_id": "r",
                                "params": {"temperature": 0, "max_tokens": 8,
                                           "ignore_eos": True}}])
        return [t for o in outs["r"] for t in o.token_ids]

    a, b, c = engine(ckpt), engine(ckpt), engine(other)
    assert a.model is b.model
    assert c.model is not a.model
    assert engine(ckpt, "float16").model is not a.model
    assert greedy(a) == greedy(b)
    assert greedy(c) != greedy(a)  # seed 1's weights, not seed 0's
    assert a.model.embed_tokens.weight.dtype == torch.float32


def test_a_tiny_checkpoint_drawn_again_is_the_first_draw_in_tensors_of_its_own():
    """Equal arguments give equal weights in tensors of their own, and leave torch's generator
    where the first draw left it; other arguments give other weights; and what is kept is what
    transformers' initialisation draws afresh under that seed. Negative controls, by hand: without
    restoring the generator, the numbers after the second draw differ; without the copy, the two
    draws share storage."""
    import torch
    from transformers import AutoModelForCausalLM

    from kvserve.workers.model_executor import tiny

    def draw(**kwargs):
        ckpt = tiny.tiny_checkpoint("llama", seed=3, num_hidden_layers=1, **kwargs)
        return ckpt, torch.rand(4)  # the generator's next numbers after the draw

    first, after_first = draw()
    again, after_again = draw()
    assert first.tensors.keys() == again.tensors.keys()
    for name, t in first.tensors.items():
        assert torch.equal(t, again.tensors[name]), name
        assert t.data_ptr() != again.tensors[name].data_ptr(), name
    assert torch.equal(after_first, after_again)
    again.tensors["model.norm.weight"].add_(1.0)  # writing one copy leaves the next draw alone
    assert torch.equal(draw()[0].tensors["model.norm.weight"], first.tensors["model.norm.weight"])
    assert first.tokenizer is again.tokenizer  # one default tokenizer per process

    fresh = AutoModelForCausalLM.from_config(first.config, dtype=torch.float32)
    torch.manual_seed(3)
    fresh = AutoModelForCausalLM.from_config(first.config, dtype=torch.float32)
    after_fresh = torch.rand(4)
    assert all(torch.equal(v, first.tensors[k]) for k, v in fresh.state_dict().items())
    assert torch.equal(after_fresh, after_first)

    other = tiny.tiny_checkpoint("llama", seed=3, num_hidden_layers=2)
    assert other.tensors.keys() != first.tensors.keys()
    reseeded = tiny.tiny_checkpoint("llama", seed=4, num_hidden_layers=1)
    assert not torch.equal(reseeded.tensors["model.embed_tokens.weight"],
                           first.tensors["model.embed_tokens.weight"])


def test_building_an_engine_imports_no_model_code_of_transformers_nor_dynamo(model_dir):
    """What an engine process's start leaves out (each ~0.4-0.65 CPU-s on a 2-core VM, in
    every replica): transformers' Llama module (RoPE comes from `ROPE_INIT_FUNCTIONS`),
    torch._dynamo (which nn init on the meta device imported) and sympy (which
    `Module.to_empty` imported: `builder.materialize`), in a fresh process."""
    import subprocess
    import sys

    code = ("import sys; from kvserve.workers.config import EngineConfig; "
            "from kvserve.workers.engine import LLMEngine; "
            "LLMEngine(EngineConfig(device='cpu', kv_cache_memory=16 * 1024**2)); "
            "print(sorted(m for m in ('torch._dynamo', 'sympy', 'transformers.masking_utils', "
            "'transformers.models.llama.modeling_llama') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "[]"


def test_the_config_and_tokenizer_read_without_auto_classes_equal_theirs(model_dir, tmp_path):
    """`read_config` / `read_tokenizer` skip transformers' Auto classes for a Llama config that
    writes out every field the engine reads (the default model's): the same values, the same
    RoPE tables, the same tokens and chat template; a config missing a field, or another model
    type, goes through AutoConfig."""
    import shutil

    import torch
    from transformers import AutoConfig, AutoTokenizer

    from kvserve.workers.model_executor.loader import LLAMA_FIELDS, read_config, read_tokenizer
    from kvserve.workers.model_executor.rope import RotaryEmbedding

    auto, light = AutoConfig.from_pretrained(model_dir), read_config(model_dir)
    assert type(light) is not type(auto)  # the fast path was taken
    for name in (*LLAMA_FIELDS, "model_type", "head_dim", "attention_bias", "mlp_bias",
                 "hidden_act", "bos_token_id", "eos_token_id", "pad_token_id"):
        assert getattr(light, name, None) == getattr(auto, name, None), name
    for rope in (None, {"rope_type": "yarn", "factor": 4.0,
                        "original_max_position_embeddings": 2048}):
        tables = []
        for config in (auto, light):
            ckpt = with_rope_override(LoadedCheckpoint(model_dir, config, None, {}), rope)
            tables.append(RotaryEmbedding(ckpt.config, 4096, torch.device("cpu")).cos)
        assert torch.equal(*tables)

    ours, theirs = read_tokenizer(model_dir), AutoTokenizer.from_pretrained(model_dir)
    assert type(ours) is type(theirs)
    for text in ("Hello, world!", "def f(x):\n    return x ** 2", "北京是中国的首都 🚀",
                 "<|im_start|>user\nhi<|im_end|>"):
        assert ours(text).input_ids == theirs(text).input_ids
        assert ours.decode(ours(text).input_ids) == theirs.decode(theirs(text).input_ids)
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi?"}]
    assert (ours.apply_chat_template(chat, add_generation_prompt=True)
            == theirs.apply_chat_template(chat, add_generation_prompt=True))
    assert (ours.all_special_ids, ours.eos_token_id, ours.pad_token_id) == (
        theirs.all_special_ids, theirs.eos_token_id, theirs.pad_token_id)

    # a config.json without one of the fields: the class's defaults decide, through AutoConfig
    partial = tmp_path / "partial"
    shutil.copytree(model_dir, partial, ignore=shutil.ignore_patterns("*.safetensors"))
    data = json.loads((partial / "config.json").read_text())
    del data["num_key_value_heads"]
    (partial / "config.json").write_text(json.dumps(data))
    assert type(read_config(partial)) is type(auto)
    assert read_config(partial).num_key_value_heads == data["num_attention_heads"]
