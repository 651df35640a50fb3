"""A tiny randomly initialised Llama-family checkpoint, built in code, for fast tests."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from workers.loader import LoadedCheckpoint, override_rope, resolve_model_dir


def tiny_config(model_type: str = "llama", **overrides: Any):
    """A 2-layer GQA config of `model_type` (llama, qwen2, mistral) with the SmolLM2 vocabulary."""
    from transformers import AutoConfig

    values: dict[str, Any] = dict(
        vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        max_position_embeddings=512, rms_norm_eps=1e-5, tie_word_embeddings=True,
        bos_token_id=1, eos_token_id=2,
    )
    values.update(overrides)
    return AutoConfig.for_model(model_type, **values)


def tiny_checkpoint(
    model_type: str = "llama", seed: int = 0, rope_parameters: dict[str, Any] | None = None,
    **overrides: Any,
) -> LoadedCheckpoint:
    """Random weights from transformers' own model class, with the default model's tokenizer."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    config = tiny_config(model_type, **overrides)
    if rope_parameters:
        config.rope_parameters = override_rope(config, rope_parameters)
    torch.manual_seed(seed)
    hf_model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    tensors = {k: v.clone() for k, v in hf_model.state_dict().items()}
    tokenizer = AutoTokenizer.from_pretrained(resolve_model_dir(None))
    return LoadedCheckpoint(Path(f"tiny-{model_type}"), config, tokenizer, tensors)
