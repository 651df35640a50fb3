"""Turns one step's scheduled chunks into tensors, runs the model, returns the logits to sample."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from kvserve.workers.core.kv_events import KVCopyPlan
from kvserve.workers.core.scheduler import ScheduledChunk
from kvserve.workers.model_executor.attention import AttentionMetadata
from kvserve.workers.model_executor.attention import metadata as attention_metadata
from kvserve.workers.model_executor.cuda_graphs import DecodeGraphs
from kvserve.workers.model_executor.kv_cache import KVCacheSpec, allocate_kv_cache
from kvserve.workers.model_executor.kv_transfer import KVCopier
from kvserve.workers.model_executor.model import CausalLM
from kvserve.workers.model_executor.rope import RopeSpan, RotaryEmbedding


@dataclass(frozen=True)
class StepPlan:
    """One step's batch as host lists: everything a rank needs to build the step's tensors
    (`ModelRunner.inputs`) and nothing of the requests behind it. Under tensor parallelism
    rank 0 sends it to the other ranks, one message per step, and each builds the same
    tensors from it."""

    input_ids: list[int]  # [tokens]
    positions: list[int]  # [tokens]
    slots: list[int]  # [tokens]: the cache slot each token's K/V goes to
    decodes: list[tuple[list[int], int]]  # per decode row: (block table, context length)
    prefills: list[tuple[list[int], int, int]]  # per chunk: (block table, tokens, context)
    logits_rows: list[int]  # the rows whose logits are sampled
    rope_spans: list[RopeSpan]  # each chunk's start, size and prompt length


@dataclass
class ModelInput:
    plan: StepPlan
    input_ids: torch.Tensor  # [tokens] long
    positions: torch.Tensor  # [tokens] long
    rope_spans: list[RopeSpan]  # each chunk's start, size and prompt length (host ints)
    meta: AttentionMetadata
    # [logit rows] long: the last row of each chunk that samples; every row of a chunk with
    # speculative drafts (one per draft, and one more)
    logits_rows: torch.Tensor
    # rank 0: the chunks behind the rows (empty on the other ranks of a tp group)
    sampling: list[ScheduledChunk]  # in the order of logits_rows
    chunks: list[ScheduledChunk]  # in row order: decodes first, then prefill chunks


@dataclass(frozen=True)
class ForwardView:
    """One step's model input and output as the model saw them, for debuggers (`kvserve trace
    --explain`): the real tensors, not a recomputation. Per chunk, in row order: its request,
    rows, the block table its attention read and the keys it attended to."""

    request_ids: tuple[str, ...]
    row_starts: tuple[int, ...]  # first row of each chunk in the flat batch
    num_rows: tuple[int, ...]
    block_tables: tuple[tuple[int, ...], ...]  # the blocks each chunk's attention read
    context_lens: tuple[int, ...]  # keys each chunk's queries attend to (cached + its own)
    input_ids: torch.Tensor  # [tokens]
    positions: torch.Tensor  # [tokens]: RoPE positions
    slot_mapping: torch.Tensor  # [tokens]: cache slot each token's K/V was written to
    kv_cache: list[tuple[torch.Tensor, torch.Tensor]]  # per layer (k, v), the pool itself
    logits: torch.Tensor  # [sampling chunks, vocab]
    sampling_ids: tuple[str, ...]  # the requests of the logits rows, in order


class StepSender(Protocol):
    """Rank 0's link to the other ranks of a tensor-parallel group
    (`kvserve.workers.parallel.ranks.Followers`): each KV copy and each step goes to them
    before rank 0 runs it."""

    def send_copy(self, plan: KVCopyPlan) -> None: ...

    def copies_done(self) -> None: ...

    def send_step(self, plan: StepPlan) -> None: ...


class ModelRunner:
    def __init__(
        self, model: CausalLM, spec: KVCacheSpec, num_blocks: int, rope: RotaryEmbedding,
        backend, device: torch.device, num_host_blocks: int = 0,
        followers: StepSender | None = None,
    ) -> None:
        """`followers`: rank 0 of a tp group sends them every copy and step first."""
        self.model = model
        self.followers = followers
        self.block_size = spec.block_size
        self.kv_cache = allocate_kv_cache(spec, num_blocks, device)
        self.host_kv_cache = allocate_kv_cache(
            spec, num_host_blocks, torch.device("cpu"), pin_memory=device.type == "cuda")
        # on CUDA: a side stream and pinned staging, ordered by events (kv_transfer.py)
        self.copier = KVCopier(self.kv_cache, self.host_kv_cache)
        self.rope = rope
        self.backend = backend
        self.device = device
        self.graphs: DecodeGraphs | None = None  # enable_decode_graphs

    @torch.inference_mode()
    def enable_decode_graphs(self, sizes: list[int], max_model_len: int, capture: bool) -> None:
        """Serve pure-decode steps of up to max(sizes) rows from `DecodeGraphs` (captured now
        when `capture`, CUDA only; otherwise their static-buffer path runs eagerly, for tests).
        The backend must launch on batch-size grids alone (`supports_cuda_graphs`)."""
        if not getattr(self.backend, "supports_cuda_graphs", False):
            raise ValueError(f"attention backend {self.backend.name} cannot run in CUDA graphs")
        spec = self.kv_cache[0][0]  # [blocks, block_size, kv_heads, head_dim]
        graphs = DecodeGraphs(
            self._decode_forward, sizes, max_blocks=-(-max_model_len // self.block_size),
            head_dim=spec.shape[-1], dtype=spec.dtype, device=self.device, capture=capture,
            rope_parts=len(self.rope.parts or [self.rope]))
        if capture:
            graphs.capture_all()
        self.graphs = graphs

    def _decode_forward(self, input_ids: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                        meta: AttentionMetadata) -> torch.Tensor:
        return self.model(input_ids, cos, sin, self.kv_cache, meta, self.backend)

    @torch.inference_mode()
    def copy(self, plan: KVCopyPlan) -> None:
        """Run a step's KV copies: device->host first (their device blocks may be reused by
        this step), then host->device. On CUDA they are asynchronous; the model's stream (the
        current one) waits for them on the device, and device->host data reaches
        `host_kv_cache` later (`self.copier.flush()` before reading it directly). Under tp,
        every rank copies the same blocks (its heads of them), and this returns once all
        have."""
        if self.followers is not None:
            self.followers.send_copy(plan)
        self.copier.copy(plan)
        if self.followers is not None:
            self.followers.copies_done()

    @torch.inference_mode()
    def forward(self, inp: ModelInput) -> torch.Tensor | None:
        """The model over a prepared step: logits [sampling chunks, vocab] (`inp.sampling`);
        None on a tp group's other ranks."""
        if self.followers is not None:
            self.followers.send_step(inp.plan)
        cos, sin = self.rope.lookup(inp.positions, inp.rope_spans)
        if self.graphs is not None and self.graphs.covers(inp.meta):
            hidden = self.graphs.run(inp.input_ids, cos, sin, inp.meta)
        else:
            hidden = self.model(inp.input_ids, cos, sin, self.kv_cache, inp.meta, self.backend)
        if not inp.plan.logits_rows and self.model.tp is not None:  # no gather of 0 rows
            return hidden.new_empty(0, self.model.config.vocab_size, dtype=torch.float32)
        return self.model.compute_logits(hidden[inp.logits_rows])

    def prepare(self, chunks: list[ScheduledChunk]) -> ModelInput:
        """The step's tensors, all from one host->device copy (`attention.metadata.build`).

        Decodes (one token with context) come first, batched; then prefill chunks one by one.
        A decode with k speculative drafts is k + 1 decode rows, the j-th attending to the
        context up to its own position: every layer writes the K/V of all rows before any row
        attends, so row j sees drafts 0..j-1 in the cache, and each row is computed exactly as
        the decode step that would have produced it (the same kernels, the same context, and
        matmuls whose rows do not depend on the batch). So verification changes no number."""
        decodes = [c for c in chunks if c.is_decode]
        prefills = [c for c in chunks if not c.is_decode]
        ordered = decodes + prefills
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        rows: list[int] = []
        sampling: list[ScheduledChunk] = []
        for chunk in ordered:
            start, end = chunk.start, chunk.start + chunk.num_tokens
            ids += chunk.seq.token_ids[start:end - len(chunk.drafts)] + chunk.drafts
            positions += range(start, end)
            slots += self._slots(chunk.seq.block_table, start, end)
            if chunk.samples:
                rows += range(len(ids) - 1 - len(chunk.drafts), len(ids))
                sampling.append(chunk)
        # each table cut to the blocks its chunk's context needs, one list per chunk: the plan
        # a rank is sent carries what the kernels read, once
        tables = {id(c): c.seq.block_table[:-(-(c.start + c.num_tokens) // self.block_size)]
                  for c in ordered}
        plan = StepPlan(
            input_ids=ids, positions=positions, slots=slots,
            decodes=[(tables[id(c)], c.start + 1 + j) for c in decodes
                     for j in range(c.num_tokens)],
            prefills=[(tables[id(c)], c.num_tokens, c.start + c.num_tokens) for c in prefills],
            logits_rows=rows,
            rope_spans=[RopeSpan(c.start, c.num_tokens, c.seq.num_prompt_tokens) for c in ordered],
        )
        return self.inputs(plan, sampling, ordered)

    def inputs(self, plan: StepPlan, sampling: list[ScheduledChunk] | None = None,
               chunks: list[ScheduledChunk] | None = None) -> ModelInput:
        """The step's tensors from its plan (`prepare` on rank 0; the other ranks of a tp group
        from the plan rank 0 sent)."""
        meta, (input_ids, pos, logits_rows) = attention_metadata.build(
            self.device, plan.slots, decodes=plan.decodes, prefills=plan.prefills,
            block_size=self.block_size,
            extra=[plan.input_ids, plan.positions, plan.logits_rows],
        )
        return ModelInput(
            plan=plan, input_ids=input_ids, positions=pos, rope_spans=plan.rope_spans,
            meta=meta, logits_rows=logits_rows, sampling=sampling or [], chunks=chunks or [],
        )

    def view(self, inp: ModelInput, logits: torch.Tensor) -> ForwardView:
        """`inp` and its logits as a ForwardView (the block tables and lengths read back from
        the attention metadata the kernels got)."""
        meta = inp.meta
        tables: list[tuple[int, ...]] = []
        lens: list[int] = []
        d_lens = meta.decode_context_lens.tolist()
        last_rows, row = [], -1  # a decode's last row (with drafts it has one per token)
        for c in inp.chunks[:len(inp.chunks) - len(meta.prefills)]:
            row += c.num_tokens
            last_rows.append(row)
        for i in last_rows:
            n = d_lens[i]
            tables.append(tuple(meta.decode_block_tables[i].tolist()[:-(-n // self.block_size)]))
            lens.append(n)
        for seg in meta.prefills:
            tables.append(tuple(seg.block_table.tolist()[:-(-seg.context_len // self.block_size)]))
            lens.append(seg.context_len)
        starts, rows, at = [], [], 0
        for c in inp.chunks:
            starts.append(at)
            rows.append(c.num_tokens)
            at += c.num_tokens
        return ForwardView(
            tuple(c.seq.request_id for c in inp.chunks), tuple(starts), tuple(rows),
            tuple(tables), tuple(lens), inp.input_ids, inp.positions, meta.slot_mapping,
            self.kv_cache, logits, tuple(c.seq.request_id for c in inp.sampling))

    def _slots(self, block_table: list[int], start: int, end: int) -> list[int]:
        bs = self.block_size
        return [block_table[p // bs] * bs + p % bs for p in range(start, end)]
