"""Pure-decode steps replayed from CUDA graphs: one graph per padded batch size.

Why: a decode step of a small model on a GPU is host-bound. The GPU computes a 1B model's step
in under 2 ms while Python and ~15 kernel launches per layer take several times that (~12 ms
of host time per step on an H200, eager). A CUDA graph records every launch of the model's
forward once, and a step then costs a few copies and one replay.

How (nano-vllm's and vLLM's recipe): a graph replays fixed addresses and fixed launch grids, so
each batch size gets its own graph over static buffers (token ids, positions, cos/sin, slot
mapping, context lengths, block tables sized for the longest sequence; cos/sin are looked up
outside, so length-dependent RoPE works unchanged), and a step of n decodes
runs the graph of the smallest captured size >= n with its inputs copied into the first n rows.
The other rows are padding: slot -1 (the RoPE/KV-write kernel writes nothing there) and
context length 0 (attention reads no key and writes zeros), so padding never touches the KV of
a request; the first n rows of the output are the step's. Only the triton backend qualifies: its
launch grids depend on the batch size alone and every length is read from device memory
(`TritonAttention.supports_cuda_graphs`). Prefill and mixed steps run eagerly.

`capture=False` runs the same static-buffer path eagerly (no graph): on a CPU it is how tests
check the bucketing, padding and slicing give the eager path's tokens exactly.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvserve.workers.model_executor.attention.metadata import AttentionMetadata

# [tokens] ids, [tokens, dim] cos, sin, metadata -> [tokens, hidden]
Forward = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata], torch.Tensor]
PAD_SLOT = -1


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, ... below max_num_seqs, and max_num_seqs itself."""
    sizes, n = [], 1
    while n < max_num_seqs:
        sizes.append(n)
        n *= 2
    return [*sizes, max_num_seqs]


def padded_size(rows: int, sizes: list[int]) -> int | None:
    """The smallest captured size that holds `rows` decode rows; None past the largest."""
    return next((s for s in sizes if s >= rows), None)


def graph_memory_bytes(
    max_rows: int, max_blocks: int, hidden: int, heads: int, kv_heads: int, head_dim: int,
    intermediate: int, dtype: torch.dtype,
) -> int:
    """What capturing costs the device, an upper estimate, taken out of the KV budget before
    the pool is sized: the static inputs, and the activations of the largest batch's forward
    (graphs share one memory pool, captured largest first, so the largest one's peak is the
    pool). Per row: the residual stream and norm output, q/k/v, attention output, gate/up and
    the activation, and the split-KV partials (fp32, 16 splits)."""
    elem = torch.tensor([], dtype=dtype).element_size()
    qkv = (heads + 2 * kv_heads) * head_dim
    per_row = elem * (4 * hidden + 2 * qkv + heads * head_dim + 3 * intermediate)
    partials = 4 * heads * 16 * (max(16, head_dim) + 2)
    static = max_rows * (8 + 8 + 4 + 4 + 4 * max_blocks + 2 * head_dim * elem)
    return max_rows * (per_row + partials) + static


@dataclass
class _Graph:
    size: int
    meta: AttentionMetadata
    graph: torch.cuda.CUDAGraph | None
    output: torch.Tensor | None  # [size, hidden]: what the graph's last replay wrote


class DecodeGraphs:
    """Static buffers and one replayable forward per batch size (`graph_batch_sizes`)."""

    def __init__(
        self, forward: Forward, sizes: list[int], max_blocks: int, head_dim: int,
        dtype: torch.dtype, device: torch.device, capture: bool, rope_parts: int = 1,
    ) -> None:
        self.forward = forward
        self.sizes = sorted(sizes)
        self.capture = capture
        n = self.sizes[-1]
        self.ids = torch.zeros(n, dtype=torch.long, device=device)
        # [rope_parts, rows, head_dim]: a block per layer type's RoPE (Gemma 3), else one
        self.cos = torch.zeros(rope_parts, n, head_dim, dtype=dtype, device=device)
        self.sin = torch.zeros(rope_parts, n, head_dim, dtype=dtype, device=device)
        self.slots = torch.full((n,), PAD_SLOT, dtype=torch.long, device=device)
        self.seq_lens = torch.zeros(n, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros(n, max_blocks, dtype=torch.int32, device=device)
        self.query_start = torch.arange(n + 1, dtype=torch.int32, device=device)
        self.graphs = {s: _Graph(s, self._meta(s), None, None) for s in self.sizes}
        self.pool = None
        self.replays = dict.fromkeys(self.sizes, 0)  # steps served, per padded size

    @property
    def max_rows(self) -> int:
        return self.sizes[-1]

    def covers(self, meta: AttentionMetadata) -> bool:
        """A pure-decode step of at most the largest captured size, whose block tables fit."""
        return (not meta.prefills and 0 < meta.num_decodes <= self.max_rows
                and meta.block_tables.shape[1] <= self.block_tables.shape[1])

    def capture_all(self) -> None:
        """Capture every size's graph, largest first, into one memory pool (CUDA only). Each
        size first runs once eagerly: Triton compiles its kernels outside the capture."""
        for entry in sorted(self.graphs.values(), key=lambda g: -g.size):
            self._pad_from(0)
            self._run_eager(entry)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                entry.output = self._run_eager(entry)
            if self.pool is None:
                self.pool = graph.pool()
            entry.graph = graph
        torch.cuda.synchronize()

    def run(self, input_ids: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
            meta: AttentionMetadata) -> torch.Tensor:
        """The step's hidden states [rows, hidden] through the graph of its padded size."""
        rows = meta.num_decodes
        entry = self.graphs[padded_size(rows, self.sizes)]
        self.ids[:rows].copy_(input_ids)
        self.cos[:, :rows].copy_(cos.view(self.cos.shape[0], rows, -1))
        self.sin[:, :rows].copy_(sin.view(self.sin.shape[0], rows, -1))
        self.slots[:rows].copy_(meta.slot_mapping)
        self.seq_lens[:rows].copy_(meta.seq_lens)
        self.block_tables[:rows, : meta.block_tables.shape[1]].copy_(meta.block_tables)
        self._pad_from(rows, entry.size)
        self.replays[entry.size] += 1
        if entry.graph is None:
            return self._run_eager(entry)[:rows]
        entry.graph.replay()
        return entry.output[:rows]

    def _pad_from(self, rows: int, end: int | None = None) -> None:
        """Rows [rows, end) are padding: no KV slot, no keys. (Their ids and cos/sin keep what
        an earlier step left there: finite values whose results are dropped.)"""
        self.slots[rows:end].fill_(PAD_SLOT)
        self.seq_lens[rows:end].fill_(0)

    def _run_eager(self, entry: _Graph) -> torch.Tensor:
        n, parts, head_dim = entry.size, self.cos.shape[0], self.cos.shape[2]
        # one part: a view; several: a copy into one [parts * n, head_dim] block, in the graph
        return self.forward(self.ids[:n], self.cos[:, :n].reshape(parts * n, head_dim),
                            self.sin[:, :n].reshape(parts * n, head_dim), entry.meta)

    def _meta(self, n: int) -> AttentionMetadata:
        """Metadata of a decode step of n rows over the static buffers. The host-side maxima
        are what the triton kernels never read (their lengths come from device memory)."""
        empty = self.query_start[:0]
        return AttentionMetadata(
            slot_mapping=self.slots[:n], num_decodes=n,
            decode_block_tables=self.block_tables[:n], decode_context_lens=self.seq_lens[:n],
            prefills=[], cu_seqlens_q=empty, cu_seqlens_k=empty,
            prefill_block_tables=self.block_tables[:0], block_tables=self.block_tables[:n],
            seq_lens=self.seq_lens[:n], query_start_loc=self.query_start[: n + 1],
            max_decode_context=0, decode_lens_equal=False)
