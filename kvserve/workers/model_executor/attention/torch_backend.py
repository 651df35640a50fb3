"""Paged attention with torch's scaled_dot_product_attention: any device, this CPU included."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvserve.workers.model_executor.attention.metadata import AttentionMetadata, PrefillSegment


def write_kv(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """k, v: [tokens, kv_heads, head_dim] into caches [blocks, block_size, kv_heads, head_dim]."""
    k_cache.view(-1, *k.shape[1:]).index_copy_(0, slot_mapping, k)
    v_cache.view(-1, *v.shape[1:]).index_copy_(0, slot_mapping, v)


def gather_kv(cache: torch.Tensor, block_tables: torch.Tensor, length: int) -> torch.Tensor:
    """cache: [blocks, block_size, kv_heads, head_dim] -> [seqs, kv_heads, length, head_dim]."""
    seqs = block_tables.shape[0]
    # only the blocks `length` needs: in a mixed step the tables are as wide as the longest
    # sequence's, prefill chunks included
    block_tables = block_tables[:, : -(-length // cache.shape[1])]
    # index_select copies whole blocks: ~5x faster on CPU than advanced indexing cache[tables]
    gathered = cache.index_select(0, block_tables.flatten())  # [seqs * max_blocks, block_size, ...]
    gathered = gathered.view(seqs, -1, *cache.shape[2:])[:, :length]
    return gathered.transpose(1, 2)


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
         scale: float, softcap: float = 0.0, is_causal: bool = False) -> torch.Tensor:
    """scaled_dot_product_attention, GQA by broadcast (q: [b, heads, q_len, d] or grouped
    [b, kv_heads, group, d]; k, v: [b, kv_heads, k_len, d]). With `softcap` (Gemma 2), which
    SDPA has no place for, the steps of transformers' eager attention in its order and dtypes:
    scores in the input dtype, capped, masked, softmax in fp32, rounded back, times v."""
    if not softcap:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal,
                                              scale=scale, enable_gqa=True)
    if q.shape[1] != k.shape[1]:  # (a grouped q has the kv heads already)
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)  # [b, heads, k_len, d]
        v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    scores = torch.tanh(scores / softcap) * softcap
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(probs, v)


class PagedAttention:
    """Writes the step's K/V into the cache, then attends: decodes first, prefill chunks after."""

    name = "base"

    def __call__(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
        k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
        window: int = 0, softcap: float = 0.0,
    ) -> torch.Tensor:
        # q: [tokens, heads, head_dim]; k, v: [tokens, kv_heads, head_dim]
        write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        return self.attend(q, k, v, k_cache, v_cache, meta, scale, window, softcap)

    def attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
        k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
        window: int = 0, softcap: float = 0.0,
    ) -> torch.Tensor:
        """Attention over a cache that already holds the step's K/V (the model's fused RoPE
        and KV-write kernel wrote them): decodes first, prefill chunks after. `window` > 0: a
        query at position p sees the keys at p - window + 1 .. p only (a sliding-window
        layer); the blocks before its window may be freed (their table entries read as block
        0), so no backend reads keys there. `softcap` > 0 (Gemma 2): each score becomes
        softcap * tanh(score / softcap) before the mask."""
        out = torch.empty_like(q)
        nd = meta.num_decodes
        if nd:
            out[:nd] = self.decode(q[:nd], k_cache, v_cache, meta, scale, window, softcap)
        if meta.prefills:
            out[nd:] = self.prefill(q[nd:], k[nd:], v[nd:], k_cache, v_cache, meta, scale,
                                    window, softcap)
        return out

    def decode(self, q, k_cache, v_cache, meta: AttentionMetadata, scale: float,
               window: int = 0, softcap: float = 0.0) -> torch.Tensor:
        raise NotImplementedError

    def prefill(
        self, q, k, v, k_cache, v_cache, meta: AttentionMetadata, scale: float, window: int = 0,
        softcap: float = 0.0,
    ) -> torch.Tensor:
        raise NotImplementedError


class TorchAttention(PagedAttention):
    name = "torch"

    def decode(self, q, k_cache, v_cache, meta: AttentionMetadata, scale: float,
               window: int = 0, softcap: float = 0.0) -> torch.Tensor:
        length = meta.max_decode_context
        keys = gather_kv(k_cache, meta.decode_block_tables, length)
        values = gather_kv(v_cache, meta.decode_block_tables, length)
        seqs, heads, head_dim = q.shape
        kv_heads = keys.shape[1]
        # a kv head's query heads go in as its query rows: each key is read once per kv head,
        # not once per query head (one token per sequence, so one mask row serves them all)
        grouped = q.view(seqs, kv_heads, heads // kv_heads, head_dim)
        out = sdpa(grouped, keys, values, meta.decode_window_mask(window), scale,
                   softcap)  # [decodes, kv_heads, group, head_dim]
        return out.view(seqs, heads, head_dim)

    def prefill(
        self, q, k, v, k_cache, v_cache, meta: AttentionMetadata, scale: float, window: int = 0,
        softcap: float = 0.0,
    ) -> torch.Tensor:
        out = torch.empty_like(q)
        first = meta.num_decodes  # rows of q/k/v here start after the decodes
        for seg in meta.prefills:
            rows = slice(seg.q_start - first, seg.q_start - first + seg.q_len)
            out[rows] = self._chunk(q[rows], k[rows], v[rows], k_cache, v_cache, seg, scale,
                                    window, softcap)
        return out

    def _chunk(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
        k_cache: torch.Tensor, v_cache: torch.Tensor, seg: PrefillSegment, scale: float,
        window: int, softcap: float,
    ) -> torch.Tensor:
        mask = None
        offset = seg.context_len - seg.q_len  # the chunk's first position
        # the keys the chunk's first query sees, back to where its window starts: a block
        # before it may be freed (read as block 0), and is never gathered
        first_key = max(0, offset - window + 1) if window else 0
        first_key -= first_key % k_cache.shape[1]  # whole blocks
        if seg.context_len == seg.q_len:  # no earlier context: attend within the chunk
            keys, values = k.transpose(0, 1)[None], v.transpose(0, 1)[None]
        else:  # a later chunk: earlier tokens come from the cache
            table = seg.block_table[None, first_key // k_cache.shape[1]:]
            keys = gather_kv(k_cache, table, seg.context_len - first_key)
            values = gather_kv(v_cache, table, seg.context_len - first_key)
            mask = torch.ones(seg.q_len, seg.context_len - first_key, dtype=torch.bool,
                              device=q.device).tril(diagonal=offset - first_key)
        if window and seg.context_len > window:  # each row's window: key > position - window
            if mask is None:
                mask = torch.ones(seg.q_len, seg.context_len, dtype=torch.bool,
                                  device=q.device).tril()
            mask = mask.triu(diagonal=offset - first_key - window + 1)
        if mask is None and softcap:  # causal within the chunk
            mask = torch.ones(seg.q_len, seg.q_len, dtype=torch.bool, device=q.device).tril()
        out = sdpa(q.transpose(0, 1)[None], keys, values, mask, scale, softcap,
                   is_causal=mask is None)  # [1, heads, q_len, head_dim]
        return out[0].transpose(0, 1)
