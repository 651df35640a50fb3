"""Attention backends behind one call signature:
`backend(q, k, v, k_cache, v_cache, meta, scale) -> out` with q/out: [tokens, heads, head_dim].
"""

from __future__ import annotations

import torch

from workers.config import ATTENTION_BACKENDS as BACKENDS  # defined once, with the settings
from workers.model_executor.attention.flash_backend import FlashAttention, default_provider_name
from workers.model_executor.attention.metadata import AttentionMetadata, PrefillSegment
from workers.model_executor.attention.torch_backend import PagedAttention, TorchAttention
from workers.model_executor.cpu_kernels import CpuKernels


def resolve_backend_name(name: str, device: torch.device) -> str:
    """`auto` picks flash_attn on CUDA when one of its kernel providers is there (the
    flash-attn package, or torch's varlen_attn with block_table), cpu on a CPU, torch
    otherwise."""
    if name not in BACKENDS:
        raise ValueError(f"attention_backend must be one of {BACKENDS}, got {name!r}")
    if name == "auto":
        flash_ok = device.type == "cuda" and default_provider_name() is not None
        if flash_ok:
            return "flash_attn"
        return "cpu" if device.type == "cpu" else "torch"
    if name == "flash_attn" and device.type != "cuda":
        raise ValueError("attention_backend flash_attn needs a CUDA device")
    if name == "cpu" and device.type != "cpu":
        raise ValueError(f"attention_backend cpu needs the CPU device, not {device.type}")
    return name


def make_backend(name: str, cpu_kernels: CpuKernels | None = None) -> PagedAttention:
    """The backend `name` resolves to; `cpu` without `cpu_kernels` (cpu_kernels.py, which
    could not be built) is the torch backend."""
    if name == "flash_attn":
        return FlashAttention()  # its kernel provider: flash-attn, else torch's varlen_attn
    if name == "cpu":
        from workers.model_executor.attention.cpu_backend import CPUAttention

        if cpu_kernels is not None:
            return CPUAttention(cpu_kernels)
    return TorchAttention()


__all__ = [
    "AttentionMetadata", "FlashAttention", "PagedAttention", "PrefillSegment", "TorchAttention",
    "make_backend", "resolve_backend_name",
]
