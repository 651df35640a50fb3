"""FlashAttention-2 over the paged cache (CUDA only; `flash-attn` is the optional `gpu` extra).

Prefill chunks go through `flash_attn_varlen_func(..., block_table=...)`, decodes through
`flash_attn_with_kvcache(..., cache_seqlens=..., block_table=...)`. flash-attn requires the
cache's block size to be a multiple of 256 for paged KV.
"""

from __future__ import annotations

import torch

from workers.attention.metadata import AttentionMetadata
from workers.attention.torch_backend import PagedAttention

FLASH_BLOCK_MULTIPLE = 256


class FlashAttention(PagedAttention):
    name = "flash_attn"

    def __init__(self) -> None:
        from flash_attn import flash_attn_varlen_func, flash_attn_with_kvcache  # lazy: CUDA only

        self._varlen = flash_attn_varlen_func
        self._with_kvcache = flash_attn_with_kvcache

    def decode(self, q, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        return self._with_kvcache(
            q.unsqueeze(1), k_cache, v_cache,
            cache_seqlens=meta.decode_context_lens, block_table=meta.decode_block_tables,
            softmax_scale=scale, causal=True,
        ).squeeze(1)

    def prefill(
        self, q, k, v, k_cache, v_cache, meta: AttentionMetadata, scale: float
    ) -> torch.Tensor:
        # k, v are already in the cache: every chunk reads its whole context through block_table
        return self._varlen(
            q, k_cache, v_cache,
            cu_seqlens_q=meta.cu_seqlens_q, cu_seqlens_k=meta.cu_seqlens_k,
            max_seqlen_q=max(s.q_len for s in meta.prefills),
            max_seqlen_k=max(s.context_len for s in meta.prefills),
            softmax_scale=scale, causal=True, block_table=meta.prefill_block_tables,
        )
