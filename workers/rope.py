"""Rotary position embeddings computed by transformers' own RoPE code.

`LlamaRotaryEmbedding` reads `config.rope_parameters` and dispatches to transformers'
`ROPE_INIT_FUNCTIONS` (linear, dynamic, yarn, llama3, longrope), so every RoPE variant here is
exactly Hugging Face's math, attention scaling included (yarn multiplies cos and sin). The Qwen2 and
Mistral rotary classes are copies of the Llama one.

Static RoPE types are evaluated once for every position into a table. Dynamic NTK depends on the
sequence length: transformers recomputes the base for `max(position)+1` of each forward call, and
keys are cached *after* rotation, so earlier keys keep the base they were rotated with. We mirror
that per chunk: a chunk of a sequence ending at length L is rotated with the base for L (a fresh
rotary module per chunk, so batch neighbours never change each other's base).
"""

from __future__ import annotations

import torch
from transformers import PretrainedConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding


class RotaryEmbedding:
    def __init__(
        self, config: PretrainedConfig, max_positions: int, device: torch.device,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        self.config = config
        self.device = device
        self.dtype = dtype  # the activations': transformers casts cos/sin to it
        self.rope_type = config.rope_parameters.get("rope_type", "default")
        self.dynamic = "dynamic" in self.rope_type
        if not self.dynamic:
            # cos/sin: [positions, head_dim]
            self.cos, self.sin = self._evaluate(torch.arange(max_positions, device=device))

    def _evaluate(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        module = LlamaRotaryEmbedding(self.config).to(self.device)
        # evaluated in fp32, returned in the probe's dtype (as transformers does for q/k)
        probe = torch.empty(0, device=self.device, dtype=self.dtype)
        cos, sin = module(probe, positions[None, :])
        return cos[0], sin[0]

    def lookup(
        self, positions: torch.Tensor, chunk_sizes: list[int]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin [tokens, head_dim]; `chunk_sizes` splits `positions` into per-sequence chunks."""
        if not self.dynamic:
            return self.cos[positions], self.sin[positions]
        cos, sin = [], []
        start = 0
        for num_tokens in chunk_sizes:
            # the rotary module takes the sequence length as max(position)+1 of this chunk
            c, s = self._evaluate(positions[start : start + num_tokens])
            cos.append(c)
            sin.append(s)
            start += num_tokens
        return torch.cat(cos), torch.cat(sin)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [tokens, heads, head_dim]; cos/sin: [tokens, head_dim] (half-split layout, as HF)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]
