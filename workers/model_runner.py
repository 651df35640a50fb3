"""Turns one step's scheduled chunks into tensors, runs the model, returns the logits to sample."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from workers.attention import AttentionMetadata, PrefillSegment
from workers.kv_cache import KVCacheSpec, allocate_kv_cache, copy_blocks
from workers.kv_events import KVCopyPlan
from workers.model import CausalLM
from workers.rope import RotaryEmbedding
from workers.scheduler import ScheduledChunk


@dataclass
class ModelInput:
    input_ids: torch.Tensor  # [tokens]
    positions: torch.Tensor  # [tokens]
    chunk_sizes: list[int]  # tokens per chunk, in batch order
    meta: AttentionMetadata
    logits_rows: torch.Tensor  # [sampling chunks]: last row of each chunk that samples
    sampling: list[ScheduledChunk]  # in the order of logits_rows


class ModelRunner:
    def __init__(
        self, model: CausalLM, spec: KVCacheSpec, num_blocks: int, rope: RotaryEmbedding,
        backend, device: torch.device, num_host_blocks: int = 0,
    ) -> None:
        self.model = model
        self.block_size = spec.block_size
        self.kv_cache = allocate_kv_cache(spec, num_blocks, device)
        self.host_kv_cache = allocate_kv_cache(
            spec, num_host_blocks, torch.device("cpu"), pin_memory=device.type == "cuda")
        self.rope = rope
        self.backend = backend
        self.device = device

    @torch.inference_mode()
    def copy(self, plan: KVCopyPlan) -> None:
        """Run a step's KV copies: device->host first (their device blocks may be reused by
        this step), then host->device."""
        copy_blocks(self.kv_cache, [d for d, _ in plan.to_host],
                    self.host_kv_cache, [h for _, h in plan.to_host])
        copy_blocks(self.host_kv_cache, [h for h, _ in plan.to_device],
                    self.kv_cache, [d for _, d in plan.to_device])

    @torch.inference_mode()
    def execute(self, chunks: list[ScheduledChunk]) -> tuple[torch.Tensor, list[ScheduledChunk]]:
        """Compute every chunk; logits [sampling chunks, vocab] for those that reach their end."""
        inp = self.prepare(chunks)
        cos, sin = self.rope.lookup(inp.positions, inp.chunk_sizes)
        hidden = self.model(inp.input_ids, cos, sin, self.kv_cache, inp.meta, self.backend)
        return self.model.compute_logits(hidden[inp.logits_rows]), inp.sampling

    def prepare(self, chunks: list[ScheduledChunk]) -> ModelInput:
        # decodes (one token with context) first, batched; then prefill chunks one by one
        decodes = [c for c in chunks if c.num_tokens == 1 and c.start > 0]
        prefills = [c for c in chunks if not (c.num_tokens == 1 and c.start > 0)]
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        rows: list[int] = []
        sampling: list[ScheduledChunk] = []
        for chunk in decodes + prefills:
            start, end = chunk.start, chunk.start + chunk.num_tokens
            ids += chunk.seq.token_ids[start:end]
            positions += range(start, end)
            slots += self._slots(chunk.seq.block_table, start, end)
            if chunk.samples:
                rows.append(len(ids) - 1)
                sampling.append(chunk)
        meta = self._metadata(decodes, prefills, slots)
        return ModelInput(
            input_ids=self._tensor(ids), positions=self._tensor(positions),
            chunk_sizes=[c.num_tokens for c in decodes + prefills], meta=meta,
            logits_rows=self._tensor(rows), sampling=sampling,
        )

    def _slots(self, block_table: list[int], start: int, end: int) -> list[int]:
        bs = self.block_size
        return [block_table[p // bs] * bs + p % bs for p in range(start, end)]

    def _metadata(
        self, decodes: list[ScheduledChunk], prefills: list[ScheduledChunk], slots: list[int]
    ) -> AttentionMetadata:
        context = [c.start + 1 for c in decodes]
        segments, q_start = [], len(decodes)
        for c in prefills:
            table = self._tensor(c.seq.block_table[: self._blocks(c.start + c.num_tokens)])
            segments.append(PrefillSegment(q_start, c.num_tokens, c.start + c.num_tokens, table))
            q_start += c.num_tokens
        return AttentionMetadata(
            slot_mapping=self._tensor(slots),
            num_decodes=len(decodes),
            decode_block_tables=self._block_tables([c.seq.block_table for c in decodes], context),
            decode_context_lens=self._tensor(context, torch.int32),
            decode_mask=self._decode_mask(context),
            prefills=segments,
            cu_seqlens_q=self._cumsum([s.q_len for s in segments]),
            cu_seqlens_k=self._cumsum([s.context_len for s in segments]),
            prefill_block_tables=self._block_tables(
                [c.seq.block_table for c in prefills], [s.context_len for s in segments]
            ),
        )

    def _blocks(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _block_tables(self, tables: list[list[int]], lengths: list[int]) -> torch.Tensor:
        width = max((self._blocks(n) for n in lengths), default=0)
        padded = [t[: self._blocks(n)] + [0] * (width - self._blocks(n))
                  for t, n in zip(tables, lengths, strict=True)]
        return self._tensor(padded, torch.int32).view(len(tables), width)

    def _decode_mask(self, context: list[int]) -> torch.Tensor | None:
        if len(set(context)) <= 1:  # equal lengths: no padding to hide
            return None
        lens = torch.tensor(context, device=self.device)
        keys = torch.arange(max(context), device=self.device)
        return (keys[None, :] < lens[:, None])[:, None, None, :]  # [decodes, 1, 1, max_context]

    def _cumsum(self, values: list[int]) -> torch.Tensor:
        out = [0]
        for v in values:
            out.append(out[-1] + v)
        return self._tensor(out, torch.int32)

    def _tensor(self, values: list, dtype: torch.dtype = torch.long) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype, device=self.device)
