"""Fused elementwise Triton kernels for the GPU decode path: RMSNorm (optionally with the
residual add), SiLU-and-mul and RoPE with the paged KV-cache write.

Why: a decode step's decoder layer runs 2-6 small torch ops for each of these, each a kernel
launch that reads and writes a few thousand values; fused, each is one launch and one pass.

Every wrapper launches one kernel whose grid depends only on the number of rows (tokens) and on
the model's fixed widths, never on values in device memory, and does no host sync: they can be
captured in a CUDA graph. Inputs may be fp32, fp16 or bf16; the kernels compute in fp32 and
round to the input dtype exactly where the torch reference (transformers' ops) rounds, so in
fp16/bf16 they equal it bit for bit except where fp32 intermediates differ in their last bits
(sum order, exp/rsqrt implementations) across a rounding boundary of the narrow dtype.

This module imports triton at the top: callers import it lazily, on CUDA or in tests
(`tests/test_triton_ops.py` runs it under Triton's interpreter, `TRITON_INTERPRET=1`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


def _num_warps(block: int) -> int:
    """Enough warps that each thread holds at most ~16 values of a row of `block`."""
    return max(1, min(16, block // 512))


@triton.jit
def round_to(x, dtype: tl.constexpr):
    """x: fp32 -> the nearest value of `dtype` (ties to even), still held in fp32: where torch
    rounds an intermediate to the activations' dtype. bf16 is rounded by hand on the bits (the
    same RNE as the GPU's cvt.rn.bf16.f32), because Triton's interpreter truncates fp32 -> bf16
    casts; the result is exact in bf16, so a later cast to it is exact everywhere."""
    if dtype == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
        return tl.where(x != x, x, bits.to(tl.float32, bitcast=True))  # NaN stays NaN
    elif dtype == tl.float16:
        return x.to(tl.float16).to(tl.float32)
    else:
        return x


@triton.jit
def _rms_norm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, new_res_ptr,
    hidden, x_stride, res_stride, out_stride, new_res_stride, eps,
    HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    x = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * res_stride + cols, mask=mask, other=0.0)
        # residual + x: one fp32 add rounded to the dtype, as torch's add
        hf = round_to(r.to(tl.float32) + x.to(tl.float32), x.dtype)
        tl.store(new_res_ptr + row * new_res_stride + cols, hf.to(x.dtype), mask=mask)
    else:
        hf = x.to(tl.float32)
    var = tl.sum(hf * hf, axis=0) / hidden  # masked lanes are 0: they add nothing
    normed = round_to(hf * tl.rsqrt(var + eps), x.dtype)  # `x.to(dtype)`, as transformers rounds
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    # weight * normed: one fp32 product rounded to the output dtype (the promoted one)
    out_ty: tl.constexpr = out_ptr.dtype.element_ty
    out = round_to(w.to(tl.float32) * normed, out_ty)
    tl.store(out_ptr + row * out_stride + cols, out.to(out_ty), mask=mask)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """`RMSNorm.forward` (model.py) in one pass: fp32 statistics, normalized values rounded to
    x's dtype, then times `weight` (rounded to the promoted dtype of weight and x, as torch).

    With `residual`, vLLM's fused add: `new_residual = residual + x` (rounded to x's dtype) and
    the norm of it, replacing a decoder layer's `h = h + sublayer_out; x = norm(h)`; returns
    `(out, new_residual)`. Nothing is modified in place: both results are new tensors.
    """
    # x, residual: [rows, hidden] (or [..., hidden]); weight: [hidden]
    hidden = x.shape[-1]
    x2 = x.reshape(-1, hidden)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    weight = weight.contiguous()
    rows = x2.shape[0]
    out = torch.empty((rows, hidden), dtype=torch.promote_types(x.dtype, weight.dtype),
                      device=x.device)
    if residual is not None:
        if residual.shape != x.shape or residual.dtype != x.dtype:
            raise ValueError("residual must have x's shape and dtype")
        r2 = residual.reshape(-1, hidden)
        if r2.stride(-1) != 1:
            r2 = r2.contiguous()
        new_res = torch.empty((rows, hidden), dtype=x.dtype, device=x.device)
    else:  # unused by the kernel (HAS_RESIDUAL is off): any pointers do
        r2 = new_res = x2
    if rows:
        block = triton.next_power_of_2(hidden)
        _rms_norm_kernel[(rows,)](
            x2, r2, weight, out, new_res,
            hidden, x2.stride(0), r2.stride(0), out.stride(0), new_res.stride(0), eps,
            HAS_RESIDUAL=residual is not None, BLOCK=block, num_warps=_num_warps(block),
        )
    out = out.view(*x.shape[:-1], hidden)
    if residual is None:
        return out
    return out, new_res.view(x.shape)


@triton.jit
def _silu_and_mul_kernel(
    gate_up_ptr, out_ptr, inter, in_stride, out_stride, BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    gate = tl.load(gate_up_ptr + row * in_stride + cols, mask=mask, other=0.0)
    up = tl.load(gate_up_ptr + row * in_stride + inter + cols, mask=mask, other=0.0)
    g = gate.to(tl.float32)
    # F.silu: computed in fp32, rounded to the dtype; then the product, in fp32, rounded again
    silu = round_to(g / (1.0 + tl.exp(-g)), gate.dtype)
    out = round_to(silu * up.to(tl.float32), gate.dtype)
    tl.store(out_ptr + row * out_stride + cols, out.to(gate.dtype), mask=mask)


_SILU_BLOCK = 1024


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """`F.silu(gate) * up` for the fused gate/up projection's output, one pass with torch's two
    roundings (silu's result, then the product). The grid is (rows, intermediate / 1024): the
    second axis is fixed by the model's width, so only the row count varies."""
    # gate_up: [rows, 2 * inter] -> out: [rows, inter]
    inter = gate_up.shape[-1] // 2
    g2 = gate_up.reshape(-1, 2 * inter)
    if g2.stride(-1) != 1:
        g2 = g2.contiguous()
    rows = g2.shape[0]
    out = torch.empty((rows, inter), dtype=gate_up.dtype, device=gate_up.device)
    if rows and inter:
        block = min(_SILU_BLOCK, triton.next_power_of_2(inter))
        _silu_and_mul_kernel[(rows, triton.cdiv(inter, block))](
            g2, out, inter, g2.stride(0), out.stride(0),
            BLOCK=block, num_warps=_num_warps(block),
        )
    return out.view(*gate_up.shape[:-1], inter)


@triton.jit
def _rotary_write_kv_kernel(
    qkv_ptr, cos_ptr, sin_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
    qkv_stride, cos_stride, sin_stride,
    NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    ROT_BLOCK: tl.constexpr, KV_BLOCK: tl.constexpr, HALF_BLOCK: tl.constexpr,
    DIM_BLOCK: tl.constexpr,
):
    HALF: tl.constexpr = HEAD_DIM // 2
    ROTATED: tl.constexpr = NUM_HEADS + NUM_KV_HEADS
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t)  # int64; < 0: a padding row, written nowhere
    base = qkv_ptr + t * qkv_stride

    # q and k heads: [ROT_BLOCK, HALF_BLOCK] tiles of their two halves
    heads = tl.arange(0, ROT_BLOCK)[:, None]
    cols = tl.arange(0, HALF_BLOCK)[None, :]
    mask = (heads < ROTATED) & (cols < HALF)
    lo_ptr = base + heads * HEAD_DIM + cols
    x1 = tl.load(lo_ptr, mask=mask, other=0.0)
    x2 = tl.load(lo_ptr + HALF, mask=mask, other=0.0)
    cmask = cols < HALF
    cos1 = tl.load(cos_ptr + t * cos_stride + cols, mask=cmask, other=0.0).to(tl.float32)
    cos2 = tl.load(cos_ptr + t * cos_stride + HALF + cols, mask=cmask, other=0.0).to(tl.float32)
    sin1 = tl.load(sin_ptr + t * sin_stride + cols, mask=cmask, other=0.0).to(tl.float32)
    sin2 = tl.load(sin_ptr + t * sin_stride + HALF + cols, mask=cmask, other=0.0).to(tl.float32)
    dt = x1.dtype
    f1 = x1.to(tl.float32)
    f2 = x2.to(tl.float32)
    # rope.rotate: x * cos + cat(-x2, x1) * sin, each product rounded to the dtype, then the sum
    y1 = round_to(round_to(f1 * cos1, dt) + round_to(-f2 * sin1, dt), dt).to(dt)
    y2 = round_to(round_to(f2 * cos2, dt) + round_to(f1 * sin2, dt), dt).to(dt)
    tl.store(lo_ptr, y1, mask=mask)  # in place: this program loaded both halves first
    tl.store(lo_ptr + HALF, y2, mask=mask)

    # the rotated k heads (rows NUM_HEADS.. of the tile, from registers) into the cache
    kv_row = slot * (NUM_KV_HEADS * HEAD_DIM)
    is_k = (heads >= NUM_HEADS) & (heads < ROTATED)
    kmask = mask & is_k & (slot >= 0)
    k_dst = k_cache_ptr + kv_row + (heads - NUM_HEADS) * HEAD_DIM + cols
    tl.store(k_dst, y1, mask=kmask)
    tl.store(k_dst + HALF, y2, mask=kmask)

    # the v heads, copied as they are
    vh = tl.arange(0, KV_BLOCK)[:, None]
    vc = tl.arange(0, DIM_BLOCK)[None, :]
    vmask = (vh < NUM_KV_HEADS) & (vc < HEAD_DIM)
    v = tl.load(base + (ROTATED + vh) * HEAD_DIM + vc, mask=vmask, other=0.0)
    tl.store(v_cache_ptr + kv_row + vh * HEAD_DIM + vc, v, mask=vmask & (slot >= 0))


def rotary_write_kv_(
    qkv: torch.Tensor, num_heads: int, num_kv_heads: int, cos: torch.Tensor, sin: torch.Tensor,
    k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
) -> None:
    """RoPE on the q and k heads of the fused q/k/v projection's output, IN PLACE in `qkv`
    (`rope.rotate`'s roundings: each product, then the sum), then the rotated k heads and the v
    heads written to the paged caches at `slot_mapping` (`torch_backend.write_kv`), one launch.
    A token whose slot is negative (a CUDA-graph batch's padding row) writes nothing to the
    caches; its q/k are still rotated in `qkv`."""
    # qkv: [tokens, num_heads + 2 * num_kv_heads, head_dim], contiguous
    # cos, sin: [tokens, head_dim] in qkv's dtype; slot_mapping: [tokens] int64
    # k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim], contiguous
    tokens, heads, head_dim = qkv.shape
    if heads != num_heads + 2 * num_kv_heads:
        raise ValueError(f"qkv has {heads} heads, not {num_heads} + 2 * {num_kv_heads}")
    if head_dim % 2:
        raise ValueError("head_dim must be even")
    if not (qkv.is_contiguous() and k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("qkv and the caches must be contiguous")
    if k_cache.shape[-2:] != (num_kv_heads, head_dim) or v_cache.shape != k_cache.shape:
        raise ValueError("caches must be [blocks, block_size, num_kv_heads, head_dim]")
    if cos.stride(-1) != 1:
        cos = cos.contiguous()
    if sin.stride(-1) != 1:
        sin = sin.contiguous()
    if not tokens:
        return
    half_block = triton.next_power_of_2(head_dim // 2)
    rot_block = triton.next_power_of_2(num_heads + num_kv_heads)
    _rotary_write_kv_kernel[(tokens,)](
        qkv, cos, sin, k_cache, v_cache, slot_mapping,
        qkv.stride(0), cos.stride(0), sin.stride(0),
        NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim,
        ROT_BLOCK=rot_block, KV_BLOCK=triton.next_power_of_2(num_kv_heads),
        HALF_BLOCK=half_block, DIM_BLOCK=triton.next_power_of_2(head_dim),
        num_warps=_num_warps(2 * rot_block * half_block),
        # no fused multiply-adds: x * cos + rotated * sin as torch's separate ops, so fp32 too
        # equals the reference bit for bit on a GPU
        enable_fp_fusion=False,
    )
