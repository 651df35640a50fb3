"""Model resolution: the shipped GGUF is converted once to fp32 safetensors, then reused."""

from __future__ import annotations

import json

from workers.model_executor.loader import DEFAULT_MODEL, load_checkpoint, resolve_model_dir


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
