"""The KV pool: one preallocated tensor pair per layer, carved into fixed-size blocks."""

from __future__ import annotations

import mmap
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class KVCacheSpec:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype

    @property
    def bytes_per_block(self) -> int:
        elem = torch.tensor([], dtype=self.dtype).element_size()
        # K and V, every layer
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim * elem

    def num_blocks_for(self, budget_bytes: int) -> int:
        return budget_bytes // self.bytes_per_block


KVCache = list[tuple[torch.Tensor, torch.Tensor]]


def allocate_kv_cache(
    spec: KVCacheSpec, num_blocks: int, device: torch.device, pin_memory: bool = False
) -> KVCache:
    """Per layer (k, v), each [num_blocks, block_size, kv_heads, head_dim] (flash-attn's layout).
    `pin_memory` for a host tier that feeds a GPU (asynchronous copies need pinned pages)."""
    shape = (num_blocks, spec.block_size, spec.num_kv_heads, spec.head_dim)
    if device.type == "cpu" and not pin_memory and num_blocks > 0:
        pool = _zero_pages(num_blocks * spec.bytes_per_block).view(spec.dtype)
        tensors = pool.view(spec.num_layers, 2, *shape)  # [layers, k|v, blocks, ...]
        return [(layer[0], layer[1]) for layer in tensors]

    def zeros() -> torch.Tensor:
        return torch.zeros(shape, dtype=spec.dtype, device=device, pin_memory=pin_memory)

    return [(zeros(), zeros()) for _ in range(spec.num_layers)]


def _zero_pages(nbytes: int) -> torch.Tensor:
    """`nbytes` of zeros in CPU memory, committed page by page as they are first written.

    Why not torch.zeros: zeroing writes every page of the pool at start, and the first write of
    a page is what costs (on the 2-core CI VM ~2.4 s per GiB, huge pages or not: the host backs
    each new page; 4-8 CPU-s for a 1 GiB pool, most of an engine's start), for blocks a run may
    never use. The kernel gives an anonymous mapping's
    pages zeroed when first touched, so the pool reads as zeros exactly as torch.zeros does, and
    only the blocks used ever cost memory (vLLM's CPU backend leaves its pool to `torch.empty`,
    which is lazy too but not zeroed). The block manager reuses the block freed last first
    (`kvserve.workers.core.free_blocks`), so a run touches little more of the pool than its peak
    use."""
    buffer = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return torch.frombuffer(buffer, dtype=torch.uint8)  # keeps `buffer` alive, unmaps with it


def copy_blocks(src: KVCache, src_ids: list[int], dst: KVCache, dst_ids: list[int]) -> None:
    """dst[dst_ids] = src[src_ids] in every layer: one gather and one scatter per tensor.
    Synchronous: the CPU path. On CUDA the runner's `KVCopier` (kv_transfer.py) runs the
    copies asynchronously on a side stream instead."""
    if not src_ids:
        return
    src_index = torch.tensor(src_ids, device=src[0][0].device)
    dst_index = torch.tensor(dst_ids, device=dst[0][0].device)
    for src_kv, dst_kv in zip(src, dst, strict=True):
        for s, d in zip(src_kv, dst_kv, strict=True):
            blocks = s.index_select(0, src_index).to(d.device)  # [n, block_size, heads, dim]
            d.index_copy_(0, dst_index, blocks)
