"""Rotary position embeddings computed by transformers' own RoPE code.

`LlamaRotaryEmbedding` reads `config.rope_parameters` and dispatches to transformers'
`ROPE_INIT_FUNCTIONS` (linear, dynamic, yarn, llama3, longrope), so every RoPE variant here is
exactly Hugging Face's math, attention scaling included (yarn multiplies cos and sin). The Qwen2 and
Mistral rotary classes are copies of the Llama one.

Static RoPE types are evaluated once for every position into a table. Dynamic NTK depends on the
sequence length: transformers recomputes the base for `max(position)+1` of each forward call, and
keys are cached *after* rotation, so earlier keys keep the base they were rotated with. We mirror
that per chunk: a chunk of a sequence ending at length L is rotated with the base for L, as a
fresh rotary module would (so batch neighbours never change each other's base), but without
building one: the frequencies for each L are evaluated once and cached.
"""

from __future__ import annotations

import torch
from transformers import PretrainedConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
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
        else:
            module = LlamaRotaryEmbedding(config)
            self.original_len = module.original_max_seq_len
            self.original_inv_freq = module.original_inv_freq.to(device)  # [head_dim / 2]
            self.original_scaling = float(module.attention_scaling)
            self._inv_freq: dict[int, tuple[torch.Tensor, float]] = {}

    def _evaluate(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        module = LlamaRotaryEmbedding(self.config).to(self.device)
        # evaluated in fp32, returned in the probe's dtype (as transformers does for q/k)
        probe = torch.empty(0, device=self.device, dtype=self.dtype)
        cos, sin = module(probe, positions[None, :])
        return cos[0], sin[0]

    def lookup(
        self, positions: torch.Tensor, chunk_sizes: list[int], chunk_ends: list[int] | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin [tokens, head_dim]; `chunk_sizes` splits `positions` into per-sequence chunks,
        `chunk_ends` (host ints) is each chunk's max(position)+1 (read from `positions`, a device
        sync, when not given)."""
        if not self.dynamic:
            return self.cos[positions], self.sin[positions]
        if chunk_ends is None:
            chunk_ends = [int(c.max()) + 1 for c in positions.split(chunk_sizes)]
        return self._dynamic(positions, chunk_sizes, chunk_ends)

    def _dynamic(
        self, positions: torch.Tensor, chunk_sizes: list[int], chunk_ends: list[int]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """transformers' dynamic module, fresh per chunk, evaluated without building one: a chunk
        ending at length L > the trained length gets the NTK base for L, a shorter one the
        original frequencies. The same fp32 products and cos/sin as the module, bit for bit."""
        per_chunk = [self._inv_freq_for(end) for end in chunk_ends]
        scaling = {s for _, s in per_chunk}
        # inv_freq: [tokens, head_dim / 2], each chunk's row repeated over its tokens
        inv_freq = torch.cat([f.expand(n, -1) for (f, _), n in zip(per_chunk, chunk_sizes,
                                                                   strict=True)])
        freqs = positions[:, None].float() * inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)  # [tokens, head_dim]
        if len(scaling) > 1:  # not so for dynamic NTK (its factor is 1), but kept general
            factor = torch.cat([torch.full((n, 1), s, device=self.device)
                                for (_, s), n in zip(per_chunk, chunk_sizes, strict=True)])
            return (emb.cos() * factor).to(self.dtype), (emb.sin() * factor).to(self.dtype)
        (factor,) = scaling
        return (emb.cos() * factor).to(self.dtype), (emb.sin() * factor).to(self.dtype)

    def _inv_freq_for(self, length: int) -> tuple[torch.Tensor, float]:
        """([head_dim / 2] fp32 inverse frequencies, attention scaling) for a chunk ending at
        `length`, cached per length (one small evaluation per new length, on the device)."""
        if length <= self.original_len:
            return self.original_inv_freq, self.original_scaling
        cached = self._inv_freq.get(length)
        if cached is None:
            if len(self._inv_freq) >= 4096:  # lengths only grow; keep the cache bounded
                self._inv_freq.clear()
            # as a tensor, as the module passes max(position_ids)+1: its arithmetic is then fp32
            seq_len = torch.tensor(length, device=self.device)
            inv_freq, scaling = ROPE_INIT_FUNCTIONS[self.rope_type](
                self.config, self.device, seq_len=seq_len)
            cached = self._inv_freq[length] = (inv_freq.float(), float(scaling))
        return cached


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [tokens, heads, head_dim]; cos/sin: [tokens, head_dim] (half-split layout, as HF)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]
