"""FlashAttention-2 over kvserve's paged KV cache, in Triton: the kernels of the `triton` backend.

One kernel, `_attention_kernel`, computes the attention of a step's queries: decodes (one query
each), prefill chunks (many, causal inside the chunk) and the cached prefix every one of them
reads through its block table. A program owns one kv head and up to BLOCK_M query rows, the
(token, query head) pairs of a run of tokens of one sequence that share that kv head (GQA: each
key is loaded once for the whole group), and walks the keys in tiles of BLOCK_N with
FlashAttention-2's online softmax, accumulating in fp32.

Why these choices:
- Keys are found slot by slot through the block table, so any block size works (FlashAttention's
  own paged kernels want multiples of 256).
- Decodes use split-KV (flash-decoding): a long context is cut into up to MAX_SPLITS pieces that
  run side by side, and `_reduce_kernel` merges their partial softmaxes. The number of pieces is
  a function of the context length alone (`num_splits`), never of the batch, and the merge adds
  them in a fixed order: a request's numbers do not depend on its neighbours.
- Key tiles start at multiples of BLOCK_N from position 0 whatever the chunking, and a tile
  wholly past a query's causal limit changes nothing in its row (its scores are -inf: the
  rescale factor is exactly 1 and the added terms exactly 0). So a prefill row's output does
  not depend on where the scheduler cut the prompt into chunks either.
- The launch grids depend on the number of query rows and sequences only; lengths, split
  counts and block tables are read from device memory. A decode step's launch can be captured
  in a CUDA graph and replayed for any context lengths.
- Padding rows of a captured batch have seq_len 0: they read nothing and write zeros.

Under Triton's interpreter (CPU tests, `TRITON_INTERPRET=1`), `tl.dot` on bf16 operands gives
wrong results: operands are converted to fp32 first there (DOT_FP32), as they are for fp32
models on a GPU (with IEEE precision, not TF32).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kvserve.workers.model_executor.triton_ops import round_to

MAX_SPLITS = 16  # partial softmaxes per decode row, at most
SPLIT_MIN_TOKENS = 256  # a decode context is split once it is longer than this
DECODE_BLOCK_N = 64  # keys per tile
PREFILL_BLOCK_M = 64  # query rows (token x head) per prefill program
PREFILL_BLOCK_N = 64
# fp32 models' dots run on FMA units at IEEE precision, their operands held in registers:
# prefill tiles of 64 x 64 spill ~14 KB per thread at head dim 128 (sm_80 and sm_90, 4 or 8
# warps); 64 x 32 and 64 x 16 on 8 warps spill 12-28 B on sm_80 or sm_100 with one Triton
# release or the other; 32 x 32 on 4 warps spill nowhere. Decode tiles of 64 keys at head dim
# 64 spill 4-8 B on sm_80/sm_100 with Triton 3.6. (`kvserve bench gpu-compile`)
PREFILL_BLOCK_M_FP32 = 32
PREFILL_BLOCK_N_FP32 = 32
DECODE_BLOCK_N_FP32_NARROW = 32  # head dims up to 64
NUM_WARPS = 4
# prefill tiles of head dim 128 on 4 warps need 255 registers and spill 64 B on sm_80; 8 warps
# need 187 and spill nothing
WIDE_HEAD_WARPS = 8
# head dim 256 (Gemma): 16-bit prefill tiles of 64 keys spill up to 1.8 KB on sm_80 at 255
# registers, and fp32 tiles 15-21 KB on every GPU. 16-bit prefill: 32-key tiles on 8 warps;
# fp32: 16 x 16 tiles on 4 warps (on 8 they spill 12 B on sm_80 or sm_90)
WIDEST_HEAD = 256
WIDEST_BLOCK_N = 32  # 16-bit prefill
WIDEST_BLOCK_FP32 = 16  # fp32: rows and keys per tile, decode and prefill
# software-pipelined key/value tiles in flight: Triton's default. Shared memory grows with it
# (stages x (k + v tiles)): `kvserve bench gpu-compile` checks every tile shape against each
# GPU's per-block limit
NUM_STAGES = 3


@dataclass(frozen=True)
class Tiles:
    """One launch of `_attention_kernel`: its tile shape and Triton's launch options. The one
    place they are chosen (`decode_tiles`, `prefill_tiles`); `kvserve bench gpu-compile` reads
    them from the launches `paged_attention` makes and compiles each for sm_80/90/100."""

    block_m: int  # query rows (token x head) per program
    block_q: int  # tokens per program
    block_n: int  # keys per tile
    num_warps: int
    num_stages: int


def decode_tiles(group: int, head_dim_p: int, fp32: bool) -> Tiles:
    """A decode program: one token, its GQA group's heads as rows (tl.dot's minimum of 16)."""
    block_m = max(16, triton.next_power_of_2(group))
    if fp32 and head_dim_p >= WIDEST_HEAD:
        return Tiles(block_m=block_m, block_q=1, block_n=WIDEST_BLOCK_FP32,
                     num_warps=NUM_WARPS, num_stages=NUM_STAGES)
    narrow = fp32 and head_dim_p <= 64
    return Tiles(block_m=block_m, block_q=1,
                 block_n=DECODE_BLOCK_N_FP32_NARROW if narrow else DECODE_BLOCK_N,
                 num_warps=NUM_WARPS, num_stages=NUM_STAGES)


def prefill_tiles(group: int, head_dim_p: int, fp32: bool) -> Tiles:
    """A prefill program: PREFILL_BLOCK_M rows, as many tokens as fill them with the group;
    smaller tiles for fp32 models, more warps for wide 16-bit heads (each so that no GPU's
    compile spills registers)."""
    widest = head_dim_p >= WIDEST_HEAD
    if fp32:
        rows = WIDEST_BLOCK_FP32 if widest else PREFILL_BLOCK_M_FP32
        block_m = max(rows, triton.next_power_of_2(group))
        return Tiles(block_m=block_m, block_q=block_m // group,
                     block_n=WIDEST_BLOCK_FP32 if widest else PREFILL_BLOCK_N_FP32,
                     num_warps=NUM_WARPS,
                     num_stages=NUM_STAGES)
    block_m = max(PREFILL_BLOCK_M, triton.next_power_of_2(group))
    return Tiles(block_m=block_m, block_q=block_m // group,
                 block_n=WIDEST_BLOCK_N if widest else PREFILL_BLOCK_N,
                 num_warps=WIDE_HEAD_WARPS if head_dim_p >= 128 else NUM_WARPS,
                 num_stages=NUM_STAGES)


def num_splits(context_len: int, window: int = 0) -> int:
    """How many pieces a decode's keys are split into: a function of its length (or its
    sliding window's) only (the kernel's `_num_splits`, here for tests and reports)."""
    seen = min(context_len, window) if window else context_len
    return max(1, min(MAX_SPLITS, -(-seen // SPLIT_MIN_TOKENS)))


@triton.jit
def _num_splits(ctx, window, MAX_S: tl.constexpr, MIN_TOKENS: tl.constexpr):
    """`num_splits` of the keys a decode sees: its context, or its window's."""
    seen = tl.where(window > 0, tl.minimum(ctx, window), ctx)
    return tl.maximum(1, tl.minimum(MAX_S, (seen + MIN_TOKENS - 1) // MIN_TOKENS))


@triton.jit
def _find_sequence(query_start_ptr, pid, num_seqs, BLOCK_Q: tl.constexpr):
    """The sequence whose query blocks include program `pid`. Sequence i's blocks start at
    query_start[i] // BLOCK_Q + i (its tokens before it, in whole blocks, plus one spare block
    per earlier sequence for their partial last blocks), so the grid is a bound made of token
    and sequence counts alone; a binary search finds the last start <= pid. (query_start is
    counted from its first entry: the prefill chunks' rows start after the decodes'.)"""
    base = tl.load(query_start_ptr)
    lo = pid * 0
    hi = pid * 0 + num_seqs - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        start = (tl.load(query_start_ptr + mid) - base) // BLOCK_Q + mid
        lo = tl.where(start <= pid, mid, lo)
        hi = tl.where(start <= pid, hi, mid - 1)
    return lo


@triton.jit
def _attention_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, part_acc_ptr, part_m_ptr, part_l_ptr,
    block_tables_ptr, seq_lens_ptr, query_start_ptr,
    num_seqs, scale, window, softcap,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh, stride_table,
    NUM_HEADS: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
    HEAD_DIM_P: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT_KV: tl.constexpr,
    MAX_S: tl.constexpr, MIN_TOKENS: tl.constexpr, DOT_FP32: tl.constexpr,
    SOFTCAP: tl.constexpr,
):
    pid = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    if SPLIT_KV:  # decodes: a program per sequence (one query each) and split
        seq = pid
        q_block = 0
    else:
        seq = _find_sequence(query_start_ptr, pid, num_seqs, BLOCK_Q)
        first = tl.load(query_start_ptr + seq) - tl.load(query_start_ptr)
        q_block = pid - (first // BLOCK_Q + seq)
    q_first = tl.load(query_start_ptr + seq)
    q_len = tl.load(query_start_ptr + seq + 1) - q_first
    ctx = tl.load(seq_lens_ptr + seq)  # keys this sequence's last query sees
    if q_block * BLOCK_Q >= q_len:  # a spare block of the grid's bound
        return
    if SPLIT_KV:
        n_splits = _num_splits(ctx, window, MAX_S, MIN_TOKENS)
        if split >= n_splits:  # a short context: fewer splits than the grid has
            return

    # rows: (token t of this block, head h of the kv head's group), t-major
    rows = tl.arange(0, BLOCK_M)
    t = q_block * BLOCK_Q + rows // GROUP
    head = kv_head * GROUP + rows % GROUP
    row_ok = (rows // GROUP < BLOCK_Q) & (t < q_len)
    q_pos = ctx - q_len + t  # each query's position: it sees keys 0..q_pos
    dims = tl.arange(0, HEAD_DIM_P)
    dim_ok = dims < HEAD_DIM
    token = (q_first + t).to(tl.int64)
    q = tl.load(q_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh + dims[None, :],
                mask=row_ok[:, None] & dim_ok[None, :], other=0.0)  # [BLOCK_M, HEAD_DIM_P]
    if DOT_FP32:
        q = q.to(tl.float32)

    # this program's keys: [k_begin, k_end)
    k_end = tl.minimum(ctx, ctx - q_len + (q_block + 1) * BLOCK_Q)  # the last row's limit
    # a sliding window: keys from the first row's first one, k_lo, in tiles still aligned to
    # multiples of BLOCK_N (so a row's numbers do not depend on the chunking); the keys before
    # k_lo may have been freed, and are never loaded (a NaN there times p = 0 is still NaN)
    first_pos = ctx - q_len + q_block * BLOCK_Q  # the program's first row's position
    k_lo = tl.where(window > 0, tl.maximum(0, first_pos - window + 1), 0)
    k_begin = k_lo // BLOCK_N * BLOCK_N
    if SPLIT_KV:
        per_split = tl.cdiv(tl.cdiv(ctx - k_begin, n_splits), BLOCK_N) * BLOCK_N  # whole tiles
        k_begin = k_begin + split * per_split
        k_end = tl.minimum(k_end, k_begin + per_split)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_P], tl.float32)
    table = block_tables_ptr + seq.to(tl.int64) * stride_table
    for start in range(k_begin, k_end, BLOCK_N):
        pos = start + tl.arange(0, BLOCK_N)
        key_ok = (pos >= k_lo) & (pos < k_end)
        block = tl.load(table + pos // BLOCK_SIZE, mask=key_ok, other=0).to(tl.int64)
        offset = pos % BLOCK_SIZE
        # k transposed: [HEAD_DIM_P, BLOCK_N]; v: [BLOCK_N, HEAD_DIM_P]
        k = tl.load(k_cache_ptr + block[None, :] * stride_kb + offset[None, :] * stride_kt
                    + kv_head * stride_kh + dims[:, None],
                    mask=key_ok[None, :] & dim_ok[:, None], other=0.0)
        v = tl.load(v_cache_ptr + block[:, None] * stride_vb + offset[:, None] * stride_vt
                    + kv_head * stride_vh + dims[None, :],
                    mask=key_ok[:, None] & dim_ok[None, :], other=0.0)
        if DOT_FP32:  # noqa: SIM108 - Triton compiles an if on a constexpr, not a conditional
            s = tl.dot(q, k.to(tl.float32), input_precision="ieee")
        else:
            s = tl.dot(q, k)
        s = s * scale  # [BLOCK_M, BLOCK_N]
        if SOFTCAP:  # Gemma 2: softcap * tanh(s / softcap), tanh(x) = 1 - 2 / (e^2x + 1)
            s = softcap * (1.0 - 2.0 / (tl.exp(2.0 * s / softcap) + 1.0))
        seen = key_ok[None, :] & (pos[None, :] <= q_pos[:, None]) & row_ok[:, None]
        seen = seen & ((window == 0) | (pos[None, :] > q_pos[:, None] - window))
        s = tl.where(seen, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with nothing seen yet
        p = tl.exp(s - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        if DOT_FP32:
            pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
        else:
            pv = tl.dot(p.to(v.dtype), v)
        acc = acc * alpha[:, None] + pv
        m_i = m_new

    if SPLIT_KV:  # the partial softmax of this split, merged by _reduce_kernel
        part = (seq * NUM_HEADS + head).to(tl.int64) * MAX_S + split  # [BLOCK_M]
        tl.store(part_m_ptr + part, m_i, mask=row_ok)
        tl.store(part_l_ptr + part, l_i, mask=row_ok)
        tl.store(part_acc_ptr + part[:, None] * HEAD_DIM_P + dims[None, :], acc,
                 mask=row_ok[:, None])
    else:
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        out_ty: tl.constexpr = out_ptr.dtype.element_ty
        tl.store(out_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh + dims[None, :],
                 round_to(out, out_ty).to(out_ty), mask=row_ok[:, None] & dim_ok[None, :])


@triton.jit
def _reduce_kernel(
    out_ptr, part_acc_ptr, part_m_ptr, part_l_ptr, seq_lens_ptr, window, stride_ot, stride_oh,
    NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_P: tl.constexpr,
    MAX_S: tl.constexpr, MIN_TOKENS: tl.constexpr,
):
    """A decode row's output from its splits' partial softmaxes, added in split order."""
    seq = tl.program_id(0)
    head = tl.program_id(1)
    n_splits = _num_splits(tl.load(seq_lens_ptr + seq), window, MAX_S, MIN_TOKENS)
    splits = tl.arange(0, MAX_S)
    used = splits < n_splits
    part = (seq * NUM_HEADS + head).to(tl.int64) * MAX_S + splits
    m = tl.load(part_m_ptr + part, mask=used, other=float("-inf"))
    l_split = tl.load(part_l_ptr + part, mask=used, other=0.0)
    m_max = tl.max(m, 0)
    m_max = tl.where(m_max == float("-inf"), 0.0, m_max)  # a padding row: nothing seen at all
    weight = tl.where(m == float("-inf"), 0.0, tl.exp(m - m_max))  # an empty split weighs 0
    total = tl.sum(l_split * weight, 0)
    dims = tl.arange(0, HEAD_DIM_P)
    acc = tl.load(part_acc_ptr + part[:, None] * HEAD_DIM_P + dims[None, :],
                  mask=used[:, None], other=0.0)  # [MAX_S, HEAD_DIM_P]
    out = tl.sum(acc * weight[:, None], 0) / tl.where(total > 0, total, 1.0)
    out_ty: tl.constexpr = out_ptr.dtype.element_ty
    tl.store(out_ptr + seq.to(tl.int64) * stride_ot + head * stride_oh + dims,
             round_to(out, out_ty).to(out_ty), mask=dims < HEAD_DIM)


def paged_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
    seq_lens: torch.Tensor, query_start_loc: torch.Tensor, num_decodes: int, scale: float,
    dot_fp32: bool = False, max_decode_context: int | None = None, window: int = 0,
    softcap: float = 0.0,
) -> torch.Tensor:
    """Causal attention of every query row over the paged cache, which already holds them.

    q: [tokens, heads, head_dim] (any row and head strides), decodes' rows first (one each,
    sequence i at row i for i < num_decodes), then the prefill chunks' rows.
    k_cache, v_cache: [blocks, block_size, kv_heads, head_dim].
    block_tables: [seqs, max_blocks] int32; seq_lens: [seqs] int32 (keys the last query of each
    sequence sees); query_start_loc: [seqs + 1] int32 (each sequence's first row).
    -> [tokens, heads, head_dim] in q's dtype. Two launches at most (decodes, prefill chunks)
    plus the decodes' merge; their grids depend on `tokens`, `seqs` and `num_decodes` only.
    `window` > 0 (a sliding-window layer): a query at position p sees keys p - window + 1..p,
    and no key before its window is read (its block may have been freed). `softcap` > 0
    (Gemma 2): each score becomes softcap * tanh(score / softcap) before the mask.
    `max_decode_context`, when the host knows it (an eager step), trims the decodes' split axis
    to the splits the longest needs: fewer programs that would only exit, the same numbers
    (each row's split count is still its own length's). None (a CUDA graph): MAX_SPLITS."""
    tokens, heads, head_dim = q.shape
    kv_heads, block_size = k_cache.shape[2], k_cache.shape[1]
    group = heads // kv_heads
    seqs = seq_lens.shape[0]
    out = torch.empty((tokens, heads, head_dim), dtype=q.dtype, device=q.device)
    head_dim_p = max(16, triton.next_power_of_2(head_dim))
    dot_fp32 = dot_fp32 or q.dtype == torch.float32
    common = dict(NUM_HEADS=heads, GROUP=group, HEAD_DIM=head_dim, HEAD_DIM_P=head_dim_p,
                  BLOCK_SIZE=block_size, MAX_S=MAX_SPLITS, MIN_TOKENS=SPLIT_MIN_TOKENS,
                  DOT_FP32=dot_fp32, SOFTCAP=softcap > 0)
    strides = (q.stride(0), q.stride(1), out.stride(0), out.stride(1), *k_cache.stride()[:3],
               *v_cache.stride()[:3], block_tables.stride(0))
    if num_decodes:
        # the partial softmaxes: acc [decodes, heads, splits, dim], m and l [decodes, heads, splits]
        part_acc = torch.empty((num_decodes, heads, MAX_SPLITS, head_dim_p), dtype=torch.float32,
                               device=q.device)
        part_m = torch.empty((num_decodes, heads, MAX_SPLITS), dtype=torch.float32,
                             device=q.device)
        part_l = torch.empty_like(part_m)
        tiles = decode_tiles(group, head_dim_p, fp32=q.dtype == torch.float32)
        split_axis = num_splits(max_decode_context) if max_decode_context else MAX_SPLITS
        _attention_kernel[(num_decodes, kv_heads, split_axis)](
            q, k_cache, v_cache, out, part_acc, part_m, part_l,
            block_tables, seq_lens, query_start_loc, num_decodes, scale, window, softcap,
            *strides,
            BLOCK_M=tiles.block_m, BLOCK_Q=1, BLOCK_N=tiles.block_n, SPLIT_KV=True, **common,
            num_warps=tiles.num_warps, num_stages=tiles.num_stages,
        )
        _reduce_kernel[(num_decodes, heads)](
            out, part_acc, part_m, part_l, seq_lens, window, out.stride(0), out.stride(1),
            NUM_HEADS=heads, HEAD_DIM=head_dim, HEAD_DIM_P=head_dim_p, MAX_S=MAX_SPLITS,
            MIN_TOKENS=SPLIT_MIN_TOKENS, num_warps=NUM_WARPS,
        )
    num_prefills = seqs - num_decodes
    if num_prefills:
        tiles = prefill_tiles(group, head_dim_p, fp32=q.dtype == torch.float32)
        prefill_tokens = tokens - num_decodes
        # the prefill chunks' own view of the arrays: their rows, tables and lengths
        _attention_kernel[(prefill_tokens // tiles.block_q + num_prefills, kv_heads, 1)](
            q, k_cache, v_cache, out, out, out, out,
            block_tables[num_decodes:], seq_lens[num_decodes:],
            query_start_loc[num_decodes:], num_prefills, scale, window, softcap, *strides,
            BLOCK_M=tiles.block_m, BLOCK_Q=tiles.block_q, BLOCK_N=tiles.block_n,
            SPLIT_KV=False, **common, num_warps=tiles.num_warps, num_stages=tiles.num_stages,
        )
    return out
