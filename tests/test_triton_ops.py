"""The fused Triton kernels of the GPU decode path (`kvserve/workers/model_executor/triton_ops.py`)
against the torch reference they replace, in fp32, fp16 and bf16: without a GPU they run under
Triton's interpreter. Each kernel has a negative control showing that its comparison would catch
the mistake it guards against (a missing rounding step, a write of a padding row)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")  # (tests/conftest.py turns the interpreter on without a GPU)
pytestmark = pytest.mark.triton

from kvserve.workers.model_executor import triton_ops  # noqa: E402
from kvserve.workers.model_executor.attention.torch_backend import write_kv  # noqa: E402
from kvserve.workers.model_executor.model import RMSNorm  # noqa: E402
from kvserve.workers.model_executor.rope import rotate  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# about one unit in the last place of each dtype
TOL = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 8e-3}


def assert_matches(out: torch.Tensor, ref: torch.Tensor) -> float:
    """out equals ref to ~1 ulp and, in fp16/bf16, bit for bit in >= 99% of elements (the rest
    differ only through fp32 intermediates' last bits: sum order, exp, rsqrt). Returns the
    fraction of bit-identical elements."""
    assert out.dtype == ref.dtype and out.shape == ref.shape
    tol = TOL[out.dtype]
    torch.testing.assert_close(out, ref, rtol=tol, atol=tol)
    same = (out == ref).float().mean().item()
    if out.dtype != torch.float32:
        assert same >= 0.99, f"only {same:.2%} bit-identical"
    return same


def _randn(*shape: int, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, device=DEVICE) * scale).to(dtype)


@pytest.mark.parametrize("hidden", [64, 576])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rms_norm(dtype: torch.dtype, hidden: int) -> None:
    torch.manual_seed(hidden)
    rows, eps = 5, 1e-5
    norm = RMSNorm(hidden, eps).to(DEVICE)
    norm.weight.data = _randn(hidden, dtype=dtype, scale=0.5) + 1
    x = _randn(rows, hidden, dtype=dtype, scale=2.0)
    residual = _randn(rows, hidden, dtype=dtype, scale=4.0)
    x0, residual0 = x.clone(), residual.clone()

    assert_matches(triton_ops.rms_norm(x, norm.weight, eps), norm(x))

    out, new_residual = triton_ops.rms_norm(x, norm.weight, eps, residual=residual)
    h = residual + x  # a decoder layer's `h = h + sublayer_out; norm(h)`
    assert torch.equal(new_residual, h)
    assert_matches(out, norm(h))
    assert torch.equal(x, x0) and torch.equal(residual, residual0)  # nothing in place

    if dtype == torch.bfloat16 and hidden == 576:
        # negative controls: without transformers' rounding of the normalized values to the
        # dtype before the weight, or of the residual sum before the norm, the result differs
        xf = h.float()
        normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        assert not torch.equal(out, (norm.weight.float() * normed).to(dtype))
        hf = residual.float() + x.float()
        normed = hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps)
        assert not torch.equal(out, norm.weight * normed.to(dtype))


def test_rms_norm_weight_promotes() -> None:
    """An fp32 weight on bf16 activations gives fp32 out, as torch's `weight * x.to(dtype)`."""
    torch.manual_seed(0)
    norm = RMSNorm(64, 1e-6).to(DEVICE)
    norm.weight.data = _randn(64, dtype=torch.float32) + 1
    x = _randn(3, 64, dtype=torch.bfloat16)
    out = triton_ops.rms_norm(x, norm.weight, 1e-6)
    assert out.dtype == torch.float32
    assert_matches(out, norm(x))


@pytest.mark.parametrize("inter", [64, 1100])  # 1100: two column blocks of 1024, the last partial
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_silu_and_mul(dtype: torch.dtype, inter: int) -> None:
    torch.manual_seed(inter)
    gate_up = _randn(4, 2 * inter, dtype=dtype, scale=3.0)
    gate, up = gate_up.split(inter, dim=-1)
    out = triton_ops.silu_and_mul(gate_up)
    assert_matches(out, F.silu(gate) * up)
    if dtype == torch.bfloat16 and inter == 1100:
        # negative control: silu's result not rounded to bf16 before the product differs
        assert not torch.equal(out, (F.silu(gate.float()) * up.float()).to(dtype))


BLOCK_SIZE, NUM_BLOCKS, SENTINEL = 4, 8, -77.0


def _cos_sin(
    positions: torch.Tensor, head_dim: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [tokens, head_dim] in the half-split layout, as rope.py's tables."""
    inv_freq = 1.0 / (10000 ** (torch.arange(0, head_dim, 2, device=DEVICE).float() / head_dim))
    freqs = positions[:, None].float() * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


@pytest.mark.parametrize("heads", [(9, 3), (4, 4)], ids=lambda h: f"{h[0]}q{h[1]}kv")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rotary_write_kv(dtype: torch.dtype, heads: tuple[int, int]) -> None:
    num_heads, num_kv_heads = heads
    head_dim, tokens = 64, 5
    torch.manual_seed(num_heads)
    qkv = _randn(tokens, num_heads + 2 * num_kv_heads, head_dim, dtype=dtype, scale=2.0)
    cos, sin = _cos_sin(torch.tensor([3, 17, 0, 250, 1000], device=DEVICE), head_dim, dtype)
    # block tables with holes: blocks 5, 1, 6; row 2 is a CUDA-graph padding row (slot -1)
    blocks = torch.tensor([5, 1, 0, 6, 5], device=DEVICE)
    offsets = torch.tensor([2, 0, 0, 3, 3], device=DEVICE)
    slots = blocks * BLOCK_SIZE + offsets
    slots[2] = -1
    # each cache is a view after one guard block, so that a write of the padding row (slot -1,
    # the slot just before the cache) would land in memory this test sees rather than elsewhere
    shape = (NUM_BLOCKS + 1, BLOCK_SIZE, num_kv_heads, head_dim)
    k_buf = torch.full(shape, SENTINEL, dtype=dtype, device=DEVICE)
    v_buf = torch.full(shape, SENTINEL, dtype=dtype, device=DEVICE)
    k_cache, v_cache = k_buf[1:], v_buf[1:]

    # the reference: Attention.forward's rotation, then the torch backend's write of real rows
    rotated = num_heads + num_kv_heads
    ref_qkv = qkv.clone()
    ref_qkv[:, :rotated] = rotate(qkv[:, :rotated], cos, sin)
    ref_k, ref_v = k_buf.clone(), v_buf.clone()
    real = slots >= 0
    write_kv(ref_qkv[real, num_heads:rotated], ref_qkv[real, rotated:], ref_k[1:], ref_v[1:],
             slots[real])

    qkv0 = qkv.clone()
    triton_ops.rotary_write_kv_(qkv, num_heads, num_kv_heads, cos, sin, k_cache, v_cache, slots)

    assert torch.equal(qkv[:, rotated:], qkv0[:, rotated:])  # v heads: not rotated
    same = assert_matches(qkv, ref_qkv)  # q and k heads rotated in place (all rows)
    if dtype != torch.float32:
        assert same == 1.0  # products and sums of dtype values, rounded as torch: exact
    assert_matches(k_buf, ref_k)
    assert_matches(v_buf, ref_v)
    written = torch.zeros(NUM_BLOCKS + 1, BLOCK_SIZE, dtype=torch.bool, device=DEVICE)
    written.view(-1)[slots[real] + BLOCK_SIZE] = True
    assert (k_buf[~written] == SENTINEL).all() and (v_buf[~written] == SENTINEL).all()

    if dtype == torch.bfloat16 and num_heads == 9:
        # negative controls: rotating in fp32 and rounding once differs from torch's roundings;
        # an unmasked write of the padding row (to the slot before the cache) changes the buffer
        unrounded = rotate(qkv0[:, :rotated].float(), cos.float(), sin.float()).to(dtype)
        assert not torch.equal(qkv[:, :rotated], unrounded)
        unmasked_k = ref_k.clone()
        unmasked_k.view(-1, num_kv_heads, head_dim)[slots + BLOCK_SIZE] = qkv[:, num_heads:rotated]
        assert not torch.equal(k_buf, unmasked_k)
