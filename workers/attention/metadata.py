"""What every attention backend needs to know about one step's batch.

The flat token batch is ordered decodes first (one token each), then prefill chunks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class PrefillSegment:
    q_start: int  # first row of this chunk in the flat batch
    q_len: int  # tokens computed in this chunk
    context_len: int  # tokens in the cache once the chunk is written (prior context + q_len)
    block_table: torch.Tensor  # [blocks] long


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [tokens] long: cache slot of every token of the batch
    num_decodes: int
    decode_block_tables: torch.Tensor  # [decodes, max_blocks] int32, padded with 0
    decode_context_lens: torch.Tensor  # [decodes] int32
    decode_mask: torch.Tensor | None  # [decodes, 1, 1, max_context] bool; None: all lengths equal
    prefills: list[PrefillSegment]
    # varlen layout of the prefill chunks, for flash-attn
    cu_seqlens_q: torch.Tensor  # [prefills + 1] int32
    cu_seqlens_k: torch.Tensor  # [prefills + 1] int32
    prefill_block_tables: torch.Tensor  # [prefills, max_blocks] int32

    @property
    def max_decode_context(self) -> int:
        return int(self.decode_context_lens.max()) if self.num_decodes else 0
