"""Rotary position embeddings computed by transformers' own RoPE code.

The inverse frequencies of every variant come from transformers' `ROPE_INIT_FUNCTIONS` (linear,
dynamic, yarn, llama3, longrope) reading `config.rope_parameters`, and cos/sin are evaluated as
`LlamaRotaryEmbedding.forward` does, so every RoPE variant here is exactly Hugging Face's math,
attention scaling included (yarn multiplies cos and sin). The Qwen2 and Mistral rotary classes are
copies of the Llama one.

Static RoPE types are evaluated once for every position into a table. Two types depend on the
sequence length: dynamic NTK (the base grows past the trained length) and longrope (short factors
up to the trained length, long ones past it). transformers picks their frequencies from
`max(position)+1` of each forward call, and keys are cached *after* rotation. In `generate()` the
prompt is one forward call, so every prompt token is rotated for the *whole prompt's* length, and
each decoded token for the length it reaches. A serving engine splits prompts into chunks and may
preempt and recompute; to give the same answer whatever the chunking, the rotation of a token is
a function of the token alone:

    the token at position p of a request whose prompt has L tokens uses length max(p + 1, L)

(`rope_length`). That is transformers' one-forward semantics for the prompt and its per-step
rule for decoding, and recomputing a preempted request rotates every token as the first time.
Keys computed this way depend on the prompt's length once it passes the trained length, so such
requests get that length in their prefix-cache salt (`cache_key`): a cached block is reused only
by a request that would have rotated it the same way.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from transformers import PretrainedConfig


def _initial_inv_freq(config: PretrainedConfig) -> tuple[torch.Tensor, float]:
    """What `LlamaRotaryEmbedding.__init__` computes: [head_dim / 2] fp32 inverse frequencies
    from transformers' own `ROPE_INIT_FUNCTIONS` (the default RoPE's formula is the class's
    `compute_default_rope_parameters`), and the attention scaling. Without importing
    `transformers.models.llama.modeling_llama`, which cost every engine process 0.56 CPU-s (its
    masking utilities import torch._dynamo). `tests/test_rope.py` checks the tables against
    transformers' rotary classes themselves for every RoPE type (the Qwen2 and Mistral ones are
    copies of the Llama one)."""
    rope_type = config.rope_parameters["rope_type"]
    if rope_type == "default":
        base = config.rope_parameters["rope_theta"]
        dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)), 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config)
    return inv_freq, float(scaling)


def _cos_sin(freqs: torch.Tensor, scaling: float | torch.Tensor, dtype: torch.dtype
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """freqs: [tokens, head_dim / 2] fp32 (positions times inverse frequencies) -> cos/sin
    [tokens, head_dim] in `dtype`, as `LlamaRotaryEmbedding.forward`: evaluated in fp32, times
    the attention scaling, then cast (as transformers does for q/k)."""
    emb = torch.cat((freqs, freqs), dim=-1)
    return (emb.cos() * scaling).to(dtype), (emb.sin() * scaling).to(dtype)


@dataclass(frozen=True)
class RopeSpan:
    """A chunk of one request in a step, in host ints: what a length-dependent RoPE needs."""

    start: int  # position of the chunk's first token
    num_tokens: int
    prompt_len: int  # the request's prompt length L


def rope_length(position: int, prompt_len: int) -> int:
    """The sequence length whose frequencies rotate the token at `position`: max(p + 1, L)."""
    return max(position + 1, prompt_len)


def rope_kinds(config: PretrainedConfig) -> list[str] | None:
    """The layer types with a RoPE of their own (Gemma 3: `rope_parameters` keyed by layer
    type, a base of 10,000 for the local layers and 1,000,000 for the global ones), in the
    order `RotaryEmbedding.lookup` stacks them; None for one RoPE for every layer."""
    params = getattr(config, "rope_parameters", None) or {}
    if not params or not all(isinstance(p, dict) for p in params.values()):
        return None
    return sorted(params)


def rope_part(config: PretrainedConfig, layer: int) -> int | None:
    """Which of `rope_kinds`' stacked cos/sin blocks layer `layer` takes (None: there is one)."""
    kinds = rope_kinds(config)
    return None if kinds is None else kinds.index(config.layer_types[layer])


class RotaryEmbedding:
    def __init__(
        self, config: PretrainedConfig, max_positions: int, device: torch.device,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        self.config = config
        self.device = device
        self.dtype = dtype  # the activations': transformers casts cos/sin to it
        # per layer type (Gemma 3), a RotaryEmbedding each, over a copy of the config holding
        # that type's parameters, as transformers' per-type init functions read them
        self.parts: list[RotaryEmbedding] | None = None
        if kinds := rope_kinds(config):
            self.parts = []
            for kind in kinds:
                part = copy.copy(config)
                part.rope_parameters = dict(config.rope_parameters[kind])
                self.parts.append(RotaryEmbedding(part, max_positions, device, dtype))
            self.rope_type = "+".join(p.rope_type for p in self.parts)
            self.dynamic = False
            return
        self.rope_type = config.rope_parameters.get("rope_type", "default")
        self.dynamic = "dynamic" in self.rope_type or self.rope_type == "longrope"
        inv_freq, scaling = _initial_inv_freq(config)
        inv_freq = inv_freq.to(device)  # [head_dim / 2]
        if not self.dynamic:
            positions = torch.arange(max_positions, device=device)
            # cos/sin: [positions, head_dim]
            self.cos, self.sin = _cos_sin(positions[:, None].float() * inv_freq, scaling, dtype)
        else:
            self.original_len = (config.rope_parameters["original_max_position_embeddings"]
                                 if self.rope_type == "longrope"
                                 else config.max_position_embeddings)
            self.original_inv_freq, self.original_scaling = inv_freq, scaling
            self._inv_freq: dict[int, tuple[torch.Tensor, float]] = {}

    def cache_key(self, prompt_len: int) -> str:
        """What a request's cached keys depend on besides its tokens: "" unless this RoPE is
        length-dependent and the prompt passes the trained length (then its rotations depend on
        L, for dynamic NTK, or on being long, for longrope)."""
        if self.parts is not None:
            return ",".join(k for p in self.parts if (k := p.cache_key(prompt_len)))
        if not self.dynamic or prompt_len <= self.original_len:
            return ""
        return "rope:long" if self.rope_type == "longrope" else f"rope:{prompt_len}"

    def lookup(
        self, positions: torch.Tensor, spans: list[RopeSpan]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin [tokens, head_dim] for `positions` [tokens], which `spans` split into the
        step's chunks, in order (host ints: a length-dependent RoPE costs no device sync).
        Per layer type (`parts`): [types * tokens, head_dim], each type's rows in turn, in
        `rope_kinds` order (a layer takes its own block: `rope_part`)."""
        if self.parts is not None:
            tables = [part.lookup(positions, spans) for part in self.parts]
            return torch.cat([c for c, _ in tables]), torch.cat([s for _, s in tables])
        if not self.dynamic:
            return self.cos[positions], self.sin[positions]
        sizes: list[int] = []
        lengths: list[int] = []
        for span in spans:
            # the chunk's prompt tokens share the prompt's length; later ones have their own
            in_prompt = min(max(span.prompt_len - span.start, 0), span.num_tokens)
            if in_prompt:
                sizes.append(in_prompt)
                lengths.append(span.prompt_len)
            for p in range(span.start + in_prompt, span.start + span.num_tokens):
                sizes.append(1)
                lengths.append(rope_length(p, span.prompt_len))
        return self._dynamic(positions, sizes, lengths)

    def _dynamic(
        self, positions: torch.Tensor, sizes: list[int], lengths: list[int]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """transformers' module evaluated for each run of `sizes` tokens at its length, without
        building one: the same fp32 products and cos/sin as the module, bit for bit."""
        per_run = [self._inv_freq_for(length) for length in lengths]
        # inv_freq: [tokens, head_dim / 2], each run's row repeated over its tokens
        inv_freq = torch.cat([f.expand(n, -1) for (f, _), n in zip(per_run, sizes, strict=True)])
        freqs = positions[:, None].float() * inv_freq
        scaling = {s for _, s in per_run}
        if len(scaling) > 1:  # not so for dynamic NTK nor longrope, but kept general
            factor = torch.cat([torch.full((n, 1), s, device=self.device)
                                for (_, s), n in zip(per_run, sizes, strict=True)])
            return _cos_sin(freqs, factor, self.dtype)
        (factor,) = scaling
        return _cos_sin(freqs, factor, self.dtype)

    def _inv_freq_for(self, length: int) -> tuple[torch.Tensor, float]:
        """([head_dim / 2] fp32 inverse frequencies, attention scaling) for a sequence of
        `length`, cached per length (one small evaluation per new length, on the device)."""
        if length <= self.original_len:
            return self.original_inv_freq, self.original_scaling
        if self.rope_type == "longrope":  # one long set past the trained length, as transformers
            length = self.original_len + 1
        cached = self._inv_freq.get(length)
        if cached is None:
            if len(self._inv_freq) >= 4096:  # keep the cache bounded
                self._inv_freq.clear()
            # as a tensor, as the module passes max(position_ids)+1: its arithmetic is then fp32
            seq_len = torch.tensor(length, device=self.device)
            from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS  # (_initial_inv_freq)

            inv_freq, scaling = ROPE_INIT_FUNCTIONS[self.rope_type](
                self.config, self.device, seq_len=seq_len)
            if self.rope_type == "longrope":  # the module keeps its initial attention scaling
                scaling = self.original_scaling
            cached = self._inv_freq[length] = (inv_freq.float(), float(scaling))
        return cached


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [tokens, heads, head_dim]; cos/sin: [tokens, head_dim] (half-split layout, as HF)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]
