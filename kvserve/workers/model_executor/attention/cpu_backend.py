"""The CPU backend: the torch backend, with decode attention in a small C++ kernel.

A decode step's attention on the torch path copies every sequence's blocks out of the pool
(`gather_kv`) and runs SDPA over the copy; SDPA's CPU kernel pays per-(sequence, head) overhead
that dwarfs the few FLOPs of a one-token query. `paged_decode` (`csrc/paged_decode.cpp`)
reads keys and values in place through the block table, one pass per (sequence, KV head) for all
of that head's query heads, split over torch's intra-op threads (measured in the engine: 0.41 ms
per layer against 0.76 ms for gather + SDPA at 32 sequences of ~250 tokens, SmolLM2's shapes).
fp32, or bf16 (q and caches; computed in fp32, rounded to bf16 once). Prefill chunks, and what the
kernel does not cover (other dtypes; head_dim other than 64 or 128; more than 16 query heads per KV
head), keep the torch path.
"""

from __future__ import annotations

import torch

from kvserve.workers.model_executor.attention.metadata import AttentionMetadata
from kvserve.workers.model_executor.attention.torch_backend import TorchAttention
from kvserve.workers.model_executor.cpu_kernels import CpuKernels

DTYPES = (torch.float32, torch.bfloat16)
HEAD_DIMS = (64, 128)
MAX_GROUP = 16


class CPUAttention(TorchAttention):
    name = "cpu"

    def __init__(self, kernels: CpuKernels) -> None:
        self.kernels = kernels  # kvserve.workers.model_executor.cpu_kernels

    def decode(self, q, k_cache, v_cache, meta: AttentionMetadata, scale: float,
               window: int = 0, softcap: float = 0.0) -> torch.Tensor:
        # q: [decodes, heads, head_dim] -> [decodes, heads, head_dim]
        if not self.covers(q, k_cache):
            return super().decode(q, k_cache, v_cache, meta, scale, window, softcap)
        return self.kernels.paged_decode(q, k_cache, v_cache, meta.decode_block_tables,
                                         meta.decode_context_lens, scale, window, softcap)

    @staticmethod
    def covers(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
        heads, head_dim = q.shape[1:]
        return (q.dtype == k_cache.dtype and q.device.type == "cpu"
                and CPUAttention.covers_shape(q.dtype, heads, k_cache.shape[2], head_dim))

    @staticmethod
    def covers_shape(dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int) -> bool:
        return (dtype in DTYPES and head_dim in HEAD_DIMS and heads % kv_heads == 0
                and heads // kv_heads <= MAX_GROUP)
