"""Attention backends behind one call signature:
`backend(q, k, v, k_cache, v_cache, meta, scale, window) -> out` with q/out: [tokens, heads,
head_dim]; `window` > 0 for a sliding-window layer (each query sees its last `window` keys).
"""

from __future__ import annotations

import torch

from kvserve.workers.config import ATTENTION_BACKENDS as BACKENDS  # defined once, with the settings
from kvserve.workers.model_executor.attention.flash_backend import (
    FLASH_ATTN,
    FlashAttention,
    default_provider_name,
    provider_missing,
)
from kvserve.workers.model_executor.attention.metadata import AttentionMetadata, PrefillSegment
from kvserve.workers.model_executor.attention.torch_backend import PagedAttention, TorchAttention
from kvserve.workers.model_executor.attention.triton_backend import triton_missing
from kvserve.workers.model_executor.cpu_kernels import CpuKernels


def resolve_backend_name(name: str, device: torch.device) -> str:
    """`auto` on CUDA: flash_attn with the flash-attn package; else triton (kvserve's
    kernels: any block size, split-KV by length alone, CUDA graphs); else flash_attn with
    torch's varlen_attn; else torch (SDPA). On a CPU: cpu."""
    if name not in BACKENDS:
        raise ValueError(f"attention_backend must be one of {BACKENDS}, got {name!r}")
    if name == "auto":
        if device.type == "cpu":
            return "cpu"
        if device.type != "cuda":
            return "torch"
        if provider_missing(FLASH_ATTN) is None:
            return "flash_attn"
        if triton_missing(device) is None:
            return "triton"
        return "flash_attn" if default_provider_name() is not None else "torch"
    if name == "flash_attn" and device.type != "cuda":
        raise ValueError("attention_backend flash_attn needs a CUDA device")
    if name == "cpu" and device.type != "cpu":
        raise ValueError(f"attention_backend cpu needs the CPU device, not {device.type}")
    if name == "triton" and (why := triton_missing(device)):
        raise ValueError(f"attention_backend triton: {why}")
    return name


def make_backend(name: str, cpu_kernels: CpuKernels | None = None) -> PagedAttention:
    """The backend `name` resolves to; `cpu` without `cpu_kernels` (cpu_kernels.py, which
    could not be built) is the torch backend."""
    if name == "flash_attn":
        return FlashAttention()  # its kernel provider: flash-attn, else torch's varlen_attn
    if name == "triton":
        from kvserve.workers.model_executor.attention.triton_backend import TritonAttention

        return TritonAttention()
    if name == "cpu":
        from kvserve.workers.model_executor.attention.cpu_backend import CPUAttention

        if cpu_kernels is not None:
            return CPUAttention(cpu_kernels)
    return TorchAttention()


__all__ = [
    "AttentionMetadata", "FlashAttention", "PagedAttention", "PrefillSegment", "TorchAttention",
    "make_backend", "resolve_backend_name", "triton_missing",
]
