"""The model families kvserve serves, what each changes in the one model (`model.py`), and the
refusal of every other architecture.

Why one table: a checkpoint names its architecture in config.json's `model_type`, and most
decoder families share Llama's tensor names. An architecture kvserve does not implement would
load and run, and compute something else: a Qwen3 read as a Llama misses its q/k norms (the load
would stop at two unplaced tensors, but a Gemma would not, its extra norms included). So the
model refuses, at construction, any `model_type` not listed here, naming it and the list; each
family's differences from Llama are flags the model reads, and `kvserve models` prints the table.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from kvserve.workers.errors import EngineConfigError


@dataclass(frozen=True)
class Family:
    """One architecture: its `model_type`, what it changes in the Llama decoder layer, and what
    kvserve supports for it."""

    model_type: str
    name: str  # what users call it
    examples: str
    qkv_bias: bool = False  # q, k and v projections carry biases (o_proj does not)
    qk_norm: bool = False  # per-head RMSNorm on q and k, before RoPE
    # Gemma: RMSNorm weights applied as (1 + w); norms after attention and after the MLP as
    # well as before each (the "sandwich"); embeddings times sqrt(hidden); the MLP's gate
    # through tanh-approximated GELU (GeGLU); attention scaled by query_pre_attn_scalar**-0.5;
    # tanh soft-capping of attention scores and final logits where the config sets them
    gemma: bool = False
    # a sparse mixture of experts in place of the MLP (Mixtral): a router picks
    # num_experts_per_tok of num_local_experts per token, their weights renormalised
    moe: bool = False
    # what runs for it (docs/models.md): tensor parallelism, GGUF block codes on CPUs,
    # structured outputs, speculative decoding
    tensor_parallel: bool = True
    block_codes: bool = True
    structured_outputs: bool = True
    speculative: bool = True
    notes: str = ""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


FAMILIES: dict[str, Family] = {f.model_type: f for f in (
    Family("llama", "Llama", "Llama 2/3/3.1/3.2, SmolLM2, TinyLlama"),
    Family("qwen2", "Qwen2", "Qwen2, Qwen2.5", qkv_bias=True),
    Family("mistral", "Mistral", "Mistral 7B",
           notes="sliding-window attention on every layer: a request's KV blocks that have "
                 "left the window are freed (or kept in the prefix cache) while it runs"),
    Family("phi3", "Phi-3", "Phi-3-mini/small/medium, Phi-3.5-mini", block_codes=False,
           notes="q/k/v and gate/up come fused in the checkpoint (split per rank under tp); "
                 "long-RoPE scaling as transformers (short factors up to the trained length, "
                 "long past it); a partial rotary factor (Phi-4-mini) is refused; its sliding "
                 "window, where the config sets one, as Mistral's; GGUF block codes are "
                 "untested for it"),
    Family("qwen3", "Qwen3", "Qwen3 dense (0.6B-32B)", qk_norm=True, block_codes=False,
           notes="CPU decode steps run the layer op by op (the one-call C++ decode layer has "
                 "no q/k norms); GGUF block codes are untested for it"),
    Family("gemma2", "Gemma 2", "Gemma 2 2B/9B/27B", gemma=True, block_codes=False,
           notes="local (sliding) and global layers alternate: attention is exact on each, "
                 "and every block is kept (the global layers read them all); attention and "
                 "final-logit soft-capping on every backend but flash_attn with torch's "
                 "varlen_attn (no softcap there), which is refused; GGUF block codes untested"),
    Family("gemma3_text", "Gemma 3", "Gemma 3 1B (the multimodal 4B-27B are refused)",
           gemma=True,
           qk_norm=True, block_codes=False,
           notes="Gemma 2's layer, without soft-caps, with q/k norms and a RoPE per layer type "
                 "(local layers' base 10,000, global ones' 1,000,000 and their scaling); five "
                 "local layers to a global one, every block kept; GGUF block codes untested"),
    Family("mixtral", "Mixtral", "Mixtral 8x7B, 8x22B", moe=True, tensor_parallel=False,
           block_codes=False,
           notes="experts computed grouped by expert (a matmul per expert over its tokens); "
                 "the checkpoint's experts.N.w1/w2/w3 or transformers' fused gate_up_proj/"
                 "down_proj; a sliding window, where the config sets one, as Mistral's; no "
                 "tensor parallelism yet (refused)"),
)}


def layer_windows(config: Any) -> list[int]:
    """Each layer's sliding window in keys (0: full attention), as transformers reads the
    config: `layer_types` where it has them (Qwen2/3 with `use_sliding_window`, Gemma), else
    `sliding_window` on every layer (Mistral, Phi-3). A query at position p sees the keys at
    p - window + 1 .. p (transformers' `sliding_window_overlay`: kv > q - window)."""
    window = getattr(config, "sliding_window", None) or 0
    if getattr(config, "use_sliding_window", True) is False:
        window = 0
    types = getattr(config, "layer_types", None)
    if types:
        return [window if kind == "sliding_attention" else 0 for kind in types]
    return [window] * config.num_hidden_layers


def kv_window(config: Any) -> int | None:
    """The window a request's KV blocks can be freed behind: the widest layer's, when every
    layer slides (Mistral); None when a layer attends to the whole context."""
    windows = layer_windows(config)
    return max(windows) if windows and all(windows) else None


def family_of(config: Any) -> Family:
    """The family of a transformers config, or `EngineConfigError` on the `model` field naming
    its `model_type` and the supported ones."""
    model_type = getattr(config, "model_type", None)
    family = FAMILIES.get(model_type)
    if family is None:
        name = getattr(config, "name_or_path", "") or "the model"
        raise EngineConfigError(
            "model", f"{name} is a {model_type!r} model (config.json's model_type), which "
                     f"kvserve does not implement; supported: {', '.join(FAMILIES)} "
                     f"(`kvserve models` lists them)")
    rope = getattr(config, "rope_parameters", None) or {}
    partial = rope.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", None))
    if partial not in (None, 1, 1.0):
        raise EngineConfigError(
            "model", f"partial_rotary_factor {partial} (RoPE on part of each head) is not "
                     f"implemented; kvserve rotates whole heads")
    return family
