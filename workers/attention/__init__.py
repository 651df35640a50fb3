"""Attention backends behind one call signature:
`backend(q, k, v, k_cache, v_cache, meta, scale) -> out` with q/out: [tokens, heads, head_dim].
"""

from __future__ import annotations

import importlib.util

import torch

from workers.attention.metadata import AttentionMetadata, PrefillSegment
from workers.attention.torch_backend import PagedAttention, TorchAttention

BACKENDS = ("auto", "torch", "flash_attn")


def resolve_backend_name(name: str, device: torch.device) -> str:
    """`auto` picks flash_attn on CUDA when the package is installed, torch otherwise."""
    if name not in BACKENDS:
        raise ValueError(f"attention_backend must be one of {BACKENDS}, got {name!r}")
    if name == "auto":
        flash_ok = device.type == "cuda" and importlib.util.find_spec("flash_attn") is not None
        return "flash_attn" if flash_ok else "torch"
    if name == "flash_attn" and device.type != "cuda":
        raise ValueError("attention_backend flash_attn needs a CUDA device")
    return name


def make_backend(name: str) -> PagedAttention:
    if name == "flash_attn":
        from workers.attention.flash_backend import FlashAttention

        return FlashAttention()
    return TorchAttention()


__all__ = [
    "AttentionMetadata", "PagedAttention", "PrefillSegment", "TorchAttention", "make_backend",
    "resolve_backend_name",
]
