"""Pure-torch references for the GPU attention kernels the `flash_attn` backend calls.

Why: the flash kernels run only on CUDA, so on a CPU (CI) the backend's code path, every piece
of metadata it hands a kernel, would go untested. These functions take the kernels' own
signatures, check what the real kernels require (and raise where they would, or where they
would silently read or write the wrong memory), and compute the documented result in fp32 with
plain torch ops. Injected in place of the kernels (`FlashAttention(provider=...)`), they let CI
run the real backend against `TorchAttention`; on a GPU, `flash_checks.compare_with_reference`
runs the real kernels against them on the same inputs.

Semantics shared by all three kernels:
- q: [total_q, heads, head_dim] (varlen) or [batch, q_len, heads, head_dim] (kvcache);
  k/v: [total_k, kv_heads, head_dim], or with a block table a page pool
  [pages, page_size, kv_heads, head_dim] where sequence b's token t lives at
  page block_table[b, t // page_size], row t % page_size.
- GQA: query head h reads kv head h // (heads // kv_heads).
- causal is aligned bottom-right: with q_len queries over k_len keys, query i sees keys
  j <= i + k_len - q_len (a chunk over a cached prefix sees the whole prefix). A sliding window
  (left, right), -1 meaning unbounded, keeps keys with i + off - left <= j <= i + off + right.
- a query row that sees no key gets zeros (as the kernels write).

Checks the kernels do not make but the contract needs (each noted where it is made): the rows
of q must be exactly covered by cu_seqlens_q, every block id a table reads must be a page of the
pool, and a table must hold enough pages for its sequence's length; a kernel would otherwise
leave rows unwritten or read another sequence's memory.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

# what the FlashAttention-2 kernels (flash-attn and torch's aten copy of it) accept
KERNEL_DTYPES: tuple[torch.dtype, ...] = (torch.float16, torch.bfloat16)
ALL_DTYPES: tuple[torch.dtype, ...] = (torch.float32, *KERNEL_DTYPES)
# FlashAttention-2's paged KV: TORCH_CHECK(page_block_size % 256 == 0) in flash_api.cpp
PAGE_MULTIPLE = 256
MAX_HEAD_DIM = 256


class ContractError(RuntimeError):
    """An input the real kernel would reject (a TORCH_CHECK), or would silently misread."""


# -- the three kernels ----------------------------------------------------------------------


def flash_attn_varlen_func(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int, max_seqlen_k: int,
    dropout_p: float = 0.0, softmax_scale: float | None = None, causal: bool = False,
    window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0, alibi_slopes=None,
    deterministic: bool = False, return_attn_probs: bool = False,
    block_table: torch.Tensor | None = None,
    *, dtypes: Sequence[torch.dtype] = KERNEL_DTYPES, page_multiple: int = PAGE_MULTIPLE,
) -> torch.Tensor:
    """flash_attn.flash_attn_varlen_func (inference subset). With `block_table`, k/v are the
    page pool and cu_seqlens_k only gives each sequence's key count (its cumulative sum).

    `dtypes`/`page_multiple` are not kernel arguments: they default to the kernel's limits and
    a test may widen them (fp32, block 16) to exercise the caller's logic on a CPU."""
    _unsupported(dropout_p=dropout_p, alibi_slopes=alibi_slopes,
                 return_attn_probs=return_attn_probs)
    window = _causal_window(causal, window_size)
    paged = block_table is not None
    heads, kv_heads, head_dim = _check_layout(q, k, v, paged, dtypes, page_multiple)
    q_lens = _check_cu_seqlens("cu_seqlens_q", cu_seqlens_q, q, total=q.shape[0])
    k_lens = _check_cu_seqlens("cu_seqlens_k", cu_seqlens_k, q,
                               total=None if paged else k.shape[0], batch=len(q_lens))
    _check_max("max_seqlen_q", max_seqlen_q, q_lens)
    _check_max("max_seqlen_k", max_seqlen_k, k_lens)
    return _attend_packed(q, k, v, block_table, q_lens, k_lens, _starts(k_lens),
                          _scale(softmax_scale, head_dim), window, softcap)


def flash_attn_with_kvcache(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    k: torch.Tensor | None = None, v: torch.Tensor | None = None,
    rotary_cos=None, rotary_sin=None,
    cache_seqlens: torch.Tensor | int | None = None, cache_batch_idx=None, cache_leftpad=None,
    block_table: torch.Tensor | None = None, softmax_scale: float | None = None,
    causal: bool = False, window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0,
    rotary_interleaved: bool = True, alibi_slopes=None, num_splits: int = 0,
    return_softmax_lse: bool = False,
    *, dtypes: Sequence[torch.dtype] = KERNEL_DTYPES, page_multiple: int = PAGE_MULTIPLE,
) -> torch.Tensor:
    """flash_attn.flash_attn_with_kvcache (read-only subset: no k/v append, no rotary).
    q: [batch, q_len, heads, head_dim]; sequence b attends to the first cache_seqlens[b]
    tokens of its cache, bottom-right causal. `num_splits` changes only the kernel's reduction
    order, never the exact result, so the reference checks it and ignores it."""
    _unsupported(k=k, v=v, rotary_cos=rotary_cos, rotary_sin=rotary_sin,
                 cache_batch_idx=cache_batch_idx, cache_leftpad=cache_leftpad,
                 alibi_slopes=alibi_slopes, return_softmax_lse=return_softmax_lse)
    if not isinstance(num_splits, int) or num_splits < 0:
        raise ContractError(f"num_splits must be an int >= 0, got {num_splits!r}")
    window = _causal_window(causal, window_size)
    if q.dim() != 4:
        raise ContractError(f"q must be [batch, seqlen_q, heads, head_dim], got {tuple(q.shape)}")
    if q.stride(-1) != 1:
        raise ContractError("q must have contiguous last dimension")
    batch, q_len = q.shape[:2]
    paged = block_table is not None
    if not paged:
        raise ContractError("this reference covers the paged cache only: pass block_table")
    _check_layout(q.flatten(0, 1), k_cache, v_cache, paged, dtypes, page_multiple)
    if not isinstance(cache_seqlens, torch.Tensor):
        raise ContractError("cache_seqlens must be an int32 tensor [batch] (one per sequence)")
    _check_int32("cache_seqlens", cache_seqlens, q, dims=1, contiguous=True)
    if cache_seqlens.shape[0] != batch:
        raise ContractError(f"cache_seqlens must have shape ({batch},), "
                            f"got {tuple(cache_seqlens.shape)}")
    k_lens = cache_seqlens.tolist()
    if min(k_lens, default=0) < 0:
        raise ContractError(f"cache_seqlens must be >= 0, got {k_lens}")
    _check_block_table(block_table, k_cache, q, k_lens)
    scale = _scale(softmax_scale, q.shape[-1])
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)  # [batch, q_len, heads, d]
    for b, k_len in enumerate(k_lens):
        keys, values = _sequence_kv(k_cache, v_cache, block_table, b, 0, k_len)
        out[b] = _attend(q[b], keys, values, scale, window, softcap)
    return out.to(q.dtype)


def varlen_attn(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
    cu_seq_q: torch.Tensor, cu_seq_k: torch.Tensor | None, max_q: int, max_k: int,
    *, return_aux=None, scale: float | None = None,
    window_size: tuple[int, int] = (-1, -1), enable_gqa: bool = False,
    seqused_k: torch.Tensor | None = None, block_table: torch.Tensor | None = None,
    num_splits: int | None = None,
    dtypes: Sequence[torch.dtype] = KERNEL_DTYPES, page_multiple: int = PAGE_MULTIPLE,
) -> torch.Tensor:
    """torch.nn.attention.varlen.varlen_attn (torch 2.13), which runs aten's FlashAttention-2
    (`_flash_attention_forward` -> mha_varlen_fwd). Causal is `window_size=(-1, 0)`, there is
    no flag. With `block_table`, key/value are the page pool and `seqused_k` (required) gives
    each sequence's key count; cu_seq_k must still be [N+1] int32 and hold at least as many
    keys per sequence (the kernel reads its differences as the sequence's capacity).
    `num_splits` only changes the reduction order (1 = batch-invariant); checked, not used."""
    if return_aux is not None and getattr(return_aux, "lse", False):
        raise NotImplementedError("the reference does not return the log-sum-exp")
    if num_splits is not None and (not isinstance(num_splits, int) or num_splits < 0):
        raise ContractError(f"num_splits must be None or an int >= 0, got {num_splits!r}")
    if len(window_size) != 2:
        raise ContractError(f"window_size must have length 2, got {window_size!r}")
    window = (int(window_size[0]), int(window_size[1]))
    paged = block_table is not None
    heads, kv_heads, head_dim = _check_layout(query, key, value, paged, dtypes, page_multiple)
    if not enable_gqa and heads != kv_heads:  # varlen_attn's own ValueError
        raise ContractError(f"query has {heads} heads and key/value {kv_heads}: "
                            "pass enable_gqa=True")
    if cu_seq_k is None:
        raise ContractError("cu_seq_k is required with cu_seq_q (mha_varlen_fwd takes both)")
    q_lens = _check_cu_seqlens("cu_seq_q", cu_seq_q, query, total=query.shape[0])
    capacity = _check_cu_seqlens("cu_seq_k", cu_seq_k, query,
                                 total=None if paged else key.shape[0], batch=len(q_lens))
    k_lens = capacity
    if paged and seqused_k is None:
        raise ContractError("block_table requires seqused_k (the number of valid keys)")
    if seqused_k is not None:
        _check_int32("seqused_k", seqused_k, query, dims=1, contiguous=True)
        if seqused_k.shape[0] != len(q_lens):
            raise ContractError(f"seqused_k must have shape ({len(q_lens)},), "
                                f"got {tuple(seqused_k.shape)}")
        k_lens = seqused_k.tolist()
        over = [(b, u, c) for b, (u, c) in enumerate(zip(k_lens, capacity, strict=True))
                if not 0 <= u <= c]
        if over:
            raise ContractError(f"seqused_k must be within 0..cu_seq_k[b+1]-cu_seq_k[b] "
                                f"(sequence, used, capacity): {over}")
    _check_max("max_q", max_q, q_lens)
    _check_max("max_k", max_k, k_lens)
    return _attend_packed(query, key, value, block_table, q_lens, k_lens, _starts(capacity),
                          _scale(scale, head_dim), window)


# -- the math -------------------------------------------------------------------------------


def _attend_packed(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_table: torch.Tensor | None,
    q_lens: list[int], k_lens: list[int], starts_k: list[int], scale: float,
    window: tuple[int, int], softcap: float = 0.0,
) -> torch.Tensor:
    """The two varlen kernels' result: sequence b's rows of the packed q ([total_q, heads, d])
    attend to its k_lens[b] keys, packed from row starts_k[b] or, with `block_table`, in its
    pages (the table checked first)."""
    if block_table is not None:
        _check_block_table(block_table, k, q, k_lens)
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)  # [total_q, heads, d]
    q_start = 0
    for b, (q_len, k_len) in enumerate(zip(q_lens, k_lens, strict=True)):
        keys, values = _sequence_kv(k, v, block_table, b, starts_k[b], k_len)
        rows = slice(q_start, q_start + q_len)
        out[rows] = _attend(q[rows], keys, values, scale, window, softcap)
        q_start += q_len
    return out.to(q.dtype)


def _attend(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float,
    window: tuple[int, int], softcap: float = 0.0,
) -> torch.Tensor:
    """q: [q_len, heads, d]; keys/values: [k_len, kv_heads, d] -> [q_len, heads, d] fp32.
    `softcap` > 0: scaled scores become softcap * tanh(score / softcap), as flash-attn's."""
    q_len, heads, _ = q.shape
    k_len, kv_heads, _ = keys.shape
    group = heads // kv_heads
    # GQA: query head h reads kv head h // group
    keys = keys.float().repeat_interleave(group, dim=1)  # [k_len, heads, d]
    values = values.float().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.float(), keys) * scale  # [heads, q_len, k_len]
    if softcap > 0:
        scores = torch.tanh(scores / softcap) * softcap
    allowed = window_mask(q_len, k_len, window, q.device)  # [q_len, k_len]
    scores = scores.masked_fill(~allowed, float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # a row with no key: zeros
    return torch.einsum("hqk,khd->qhd", probs, values)


def window_mask(
    q_len: int, k_len: int, window: tuple[int, int], device: torch.device | None = None
) -> torch.Tensor:
    """[q_len, k_len] bool: which keys each query sees, queries aligned to the last keys."""
    i = torch.arange(q_len, device=device)[:, None] + (k_len - q_len)  # query's key position
    j = torch.arange(k_len, device=device)[None, :]
    left, right = window
    allowed = torch.ones(q_len, k_len, dtype=torch.bool, device=device)
    if left >= 0:
        allowed &= j >= i - left
    if right >= 0:
        allowed &= j <= i + right
    return allowed


def _sequence_kv(
    k: torch.Tensor, v: torch.Tensor, block_table: torch.Tensor | None, b: int, start: int,
    length: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sequence b's keys and values, [length, kv_heads, d] each, from packed rows or pages."""
    if block_table is None:
        return k[start:start + length], v[start:start + length]
    page_size = k.shape[1]
    pages = block_table[b, : -(-length // page_size)].long()
    return (k[pages].flatten(0, 1)[:length], v[pages].flatten(0, 1)[:length])


def _causal_window(causal: bool, window_size: Sequence[int]) -> tuple[int, int]:
    """flash-attn's `causal=True` is the window (left, 0)."""
    if len(window_size) != 2:
        raise ContractError(f"window_size must have length 2, got {window_size!r}")
    left, right = int(window_size[0]), int(window_size[1])
    return (left, 0) if causal else (left, right)


def _scale(scale: float | None, head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim) if scale is None else float(scale)


# -- the checks -----------------------------------------------------------------------------


def _check_layout(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, paged: bool,
    dtypes: Sequence[torch.dtype], page_multiple: int,
) -> tuple[int, int, int]:
    """q: [tokens, heads, d]; k/v: [tokens, kv_heads, d] or pages [n, page, kv_heads, d].
    Returns (heads, kv_heads, head_dim)."""
    if q.dim() != 3:
        raise ContractError(f"q must be [total_q, heads, head_dim], got {tuple(q.shape)}")
    if q.dtype not in dtypes:
        raise ContractError(f"FlashAttention supports {_names(dtypes)}, got {q.dtype}")
    for name, t in (("k", k), ("v", v)):
        if t.dtype != q.dtype:
            raise ContractError(f"q and {name} must have the same dtype: {q.dtype} vs {t.dtype}")
        if t.device != q.device:
            raise ContractError(f"{name} is on {t.device}, q on {q.device}")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.stride(-1) != 1:
            raise ContractError(f"{name} must have contiguous last dimension")
    expected_dims = 4 if paged else 3
    if k.dim() != expected_dims or v.shape != k.shape:
        layout = ("[pages, page_size, kv_heads, head_dim]" if paged
                  else "[total_k, kv_heads, head_dim]")
        raise ContractError(f"k and v must both be {layout}, got {tuple(k.shape)} and "
                            f"{tuple(v.shape)}")
    heads, head_dim = q.shape[1:]
    kv_heads = k.shape[-2]
    if k.shape[-1] != head_dim:
        raise ContractError(f"k/v head_dim {k.shape[-1]} != q head_dim {head_dim}")
    if head_dim % 8 or head_dim > MAX_HEAD_DIM:
        raise ContractError(f"head_dim must be a multiple of 8 up to {MAX_HEAD_DIM}, "
                            f"got {head_dim}")
    if kv_heads == 0 or heads % kv_heads:
        raise ContractError(f"Number of heads in key/value ({kv_heads}) must divide number of "
                            f"heads in query ({heads})")
    if paged and k.shape[1] % page_multiple:
        raise ContractError(f"Paged KV cache block size must be divisible by {page_multiple}, "
                            f"got {k.shape[1]}")
    return heads, kv_heads, head_dim


def _check_int32(
    name: str, t: torch.Tensor, q: torch.Tensor, dims: int, contiguous: bool
) -> None:
    if not isinstance(t, torch.Tensor):
        raise ContractError(f"{name} must be a tensor, got {type(t).__name__}")
    if t.dtype != torch.int32:
        raise ContractError(f"{name} must have dtype int32, got {t.dtype}")
    if t.device != q.device:
        raise ContractError(f"{name} is on {t.device}, q on {q.device}")
    if t.dim() != dims:
        raise ContractError(f"{name} must have {dims} dimension(s), got {tuple(t.shape)}")
    if contiguous and not t.is_contiguous():
        raise ContractError(f"{name} must be contiguous")
    if t.numel() and t.stride(-1) != 1:
        raise ContractError(f"{name} must have contiguous last dimension")


def _check_cu_seqlens(
    name: str, cu: torch.Tensor, q: torch.Tensor, total: int | None, batch: int | None = None
) -> list[int]:
    """Per-sequence lengths from a cumulative [batch + 1] int32 tensor that starts at 0 and
    never decreases; `total` (when the rows are packed) is the row count it must reach (q,
    stricter than the kernel: rows past the end would never be written) or not exceed (k)."""
    _check_int32(name, cu, q, dims=1, contiguous=True)
    values = cu.tolist()
    if len(values) < 2 or (batch is not None and len(values) != batch + 1):
        want = "batch + 1 >= 2" if batch is None else f"{batch + 1}"
        raise ContractError(f"{name} must have shape ({want},), got {tuple(cu.shape)}")
    if values[0] != 0:
        raise ContractError(f"{name} must start at 0, got {values[0]}")
    lens = [b - a for a, b in zip(values, values[1:], strict=False)]
    if min(lens) < 0:
        raise ContractError(f"{name} must be non-decreasing, got {values}")
    if total is not None:
        if name.endswith("q") and values[-1] != total:
            raise ContractError(f"{name} ends at {values[-1]} but q has {total} rows")
        if values[-1] > total:
            raise ContractError(f"{name} ends at {values[-1]} but k/v have {total} rows")
    return lens


def _check_max(name: str, value: int, lens: list[int]) -> None:
    """The kernel sizes its grid from the max: a smaller one would drop rows or keys."""
    if not isinstance(value, int) or isinstance(value, bool):
        raise ContractError(f"{name} must be a Python int, got {type(value).__name__}")
    if lens and value < max(lens):
        raise ContractError(f"{name}={value} is below the longest sequence ({max(lens)})")


def _check_block_table(
    block_table: torch.Tensor, pool: torch.Tensor, q: torch.Tensor, k_lens: list[int]
) -> None:
    """[batch, max_pages] int32, last dim contiguous, each row long enough for its sequence and
    naming only pages of the pool (the last two: what the kernel would misread silently)."""
    _check_int32("block_table", block_table, q, dims=2, contiguous=False)
    if block_table.shape[0] != len(k_lens):
        raise ContractError(f"block_table must have shape [batch_size={len(k_lens)}, "
                            f"max_num_blocks_per_seq], got {tuple(block_table.shape)}")
    pages, page_size = pool.shape[:2]
    width = block_table.shape[1]
    for b, k_len in enumerate(k_lens):
        needed = -(-k_len // page_size)
        if needed > width:
            raise ContractError(f"sequence {b} has {k_len} keys: {needed} pages, but its "
                                f"block_table row holds {width}")
        used = block_table[b, :needed].tolist()
        if any(not 0 <= p < pages for p in used):
            raise ContractError(f"block_table row {b} names pages outside 0..{pages - 1}: "
                                f"{used}")


def _starts(lens: list[int]) -> list[int]:
    out, total = [], 0
    for n in lens:
        out.append(total)
        total += n
    return out


def _unsupported(**args) -> None:
    """Arguments the backend never passes: refuse rather than silently ignore them."""
    for name, value in args.items():
        unset = value is None or value is False or (isinstance(value, float) and value == 0.0)
        if not unset:
            raise NotImplementedError(f"the reference does not implement {name}")


def _names(dtypes: Sequence[torch.dtype]) -> str:
    return ", ".join(str(d).removeprefix("torch.") for d in dtypes)
