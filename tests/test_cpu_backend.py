"""kvserve's C++ CPU kernels against the torch ops they replace, and their fallbacks."""

from __future__ import annotations

import sys

import pytest
import torch
import torch.nn.functional as F

from kvserve.workers.model_executor.attention import make_backend, resolve_backend_name
from kvserve.workers.model_executor.attention import metadata as attention_metadata
from kvserve.workers.model_executor.attention.cpu_backend import CPUAttention
from kvserve.workers.model_executor.attention.torch_backend import TorchAttention
from kvserve.workers.model_executor.cpu_kernels import (
    STALE_LOCK_S,
    build_dir_name,
    clear_stale_lock,
    cpu_features,
    elementwise_available_for,
    load_cpu_kernels,
)
from kvserve.workers.model_executor.model import RMSNorm
from kvserve.workers.model_executor.rope import rotate
from tests.helpers import output_ids


@pytest.fixture(scope="module")
def cpu_backend(cpu_kernels) -> CPUAttention:
    backend = make_backend("cpu", cpu_kernels)
    assert isinstance(backend, CPUAttention)
    return backend


def _decode_batch(lengths: list[int], heads: int, kv_heads: int, head_dim: int,
                  block_size: int = 16, num_blocks: int = 400, dtype=torch.float32):
    """Random caches, each sequence's blocks scattered over the pool, and a query per sequence."""
    gen = torch.Generator().manual_seed(sum(lengths) + heads + head_dim)
    shape = (num_blocks, block_size, kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen).to(dtype)
    v_cache = torch.randn(shape, generator=gen).to(dtype)
    blocks = [-(-n // block_size) for n in lengths]
    pool = torch.randperm(num_blocks, generator=gen).tolist()
    tables = [[pool.pop() for _ in range(n)] for n in blocks]
    # q as the model makes it: a slice of a wider qkv row, so rows are strided
    qkv = torch.randn(len(lengths), heads + 2 * kv_heads, head_dim, generator=gen).to(dtype)
    q = qkv[:, :heads]
    meta, _ = attention_metadata.build(
        torch.device("cpu"), [], decodes=list(zip(tables, lengths, strict=True)), prefills=[],
        block_size=block_size)
    return q, k_cache, v_cache, meta


@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [
    (9, 3, 64),     # SmolLM2
    (14, 2, 64),    # Qwen2-0.5B: 7 query heads per KV head
    (32, 8, 128),   # Llama-3-8B
    (4, 4, 64),     # no GQA
])
@pytest.mark.parametrize("lengths", [[1], [16], [17, 1, 300, 33], [250] * 8])
def test_kernel_equals_torch_path(cpu_backend, heads, kv_heads, head_dim, lengths):
    q, k_cache, v_cache, meta = _decode_batch(lengths, heads, kv_heads, head_dim)
    scale = head_dim**-0.5
    expected = TorchAttention().decode(q, k_cache, v_cache, meta, scale)
    got = cpu_backend.decode(q, k_cache, v_cache, meta, scale)
    assert got.shape == (len(lengths), heads, head_dim)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_sequence_reads_only_its_own_blocks(cpu_backend, dtype):
    """Isolation: scribbling over every block outside a sequence's table changes nothing."""
    q, k_cache, v_cache, meta = _decode_batch([40, 7], 9, 3, 64, dtype=dtype)
    before = cpu_backend.decode(q, k_cache, v_cache, meta, 0.125)
    used = set(meta.decode_block_tables[0, :3].tolist()) | {meta.decode_block_tables[1, 0].item()}
    others = [b for b in range(k_cache.shape[0]) if b not in used]
    k_cache[others] = 1e4
    v_cache[others] = -1e4
    assert torch.equal(cpu_backend.decode(q, k_cache, v_cache, meta, 0.125), before)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [1, 16, 37, 300])
def test_a_sliding_window_sees_its_last_keys_and_reads_no_block_before(cpu_backend, dtype,
                                                                       window):
    """A sliding-window layer's decode (each query sees its last `window` keys): the torch
    path's windowed mask in fp32; and the blocks wholly before each window, filled with NaN
    (freed, and maybe reused), change no bit of the kernel's output. Negative control: the
    same batch without the window differs wherever a context is longer than it."""
    lengths = [17, 1, 300, 33, 250]
    q, k_cache, v_cache, meta = _decode_batch(lengths, 9, 3, 64, dtype=dtype)
    got = cpu_backend.decode(q, k_cache, v_cache, meta, 0.125, window)
    if dtype == torch.float32:
        expected = TorchAttention().decode(q, k_cache, v_cache, meta, 0.125, window)
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    full = cpu_backend.decode(q, k_cache, v_cache, meta, 0.125)
    longer = [i for i, n in enumerate(lengths) if n > window]
    assert [i for i in range(len(lengths)) if not torch.equal(got[i], full[i])] == longer
    for i, n in enumerate(lengths):
        for b in meta.decode_block_tables[i, :max(0, n - window) // 16].tolist():
            k_cache[b] = v_cache[b] = float("nan")
    assert torch.equal(cpu_backend.decode(q, k_cache, v_cache, meta, 0.125, window), got)


@pytest.mark.parametrize("window", [0, 37])
def test_a_soft_cap_equals_the_torch_paths_eager_steps(cpu_backend, window):
    """Gemma 2's soft-capped scores in the kernel (each score capped as it is computed)
    against the torch path's eager attention. Negative control: uncapped differs."""
    q, k_cache, v_cache, meta = _decode_batch([17, 1, 300, 33], 8, 4, 128)
    got = cpu_backend.decode(q * 4, k_cache, v_cache, meta, 0.1, window, 1.5)
    expected = TorchAttention().decode(q * 4, k_cache, v_cache, meta, 0.1, window, 1.5)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    uncapped = cpu_backend.decode(q * 4, k_cache, v_cache, meta, 0.1, window)
    assert not torch.allclose(got[[0, 2, 3]], uncapped[[0, 2, 3]], rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(9, 3, 64), (32, 8, 128)])
@pytest.mark.parametrize("lengths", [[1], [17, 1, 300, 33], [250] * 8])
def test_bf16_kernel_is_the_fp32_attention_rounded_once(cpu_backend, heads, kv_heads, head_dim,
                                                        lengths):
    """bf16 q and caches, computed in fp32: within one bf16 rounding (2^-9 relative; 2^-8 here)
    of the fp32 attention over the same bf16 values, and close to the torch backend's bf16 SDPA
    (which rounds its probabilities to bf16, so it is the farther of the two from fp32)."""
    q, k_cache, v_cache, meta = _decode_batch(lengths, heads, kv_heads, head_dim,
                                              dtype=torch.bfloat16)
    assert CPUAttention.covers(q, k_cache)
    scale = head_dim**-0.5
    got = cpu_backend.decode(q, k_cache, v_cache, meta, scale)
    assert got.dtype == torch.bfloat16 and got.shape == (len(lengths), heads, head_dim)
    fp32 = TorchAttention().decode(q.float(), k_cache.float(), v_cache.float(), meta, scale)
    torch.testing.assert_close(got.float(), fp32, rtol=2.0**-8, atol=1e-5)
    torch.testing.assert_close(got, TorchAttention().decode(q, k_cache, v_cache, meta, scale),
                               rtol=1.6e-2, atol=1e-2)




def test_uncovered_dtypes_and_shapes_take_the_torch_path(cpu_backend):
    q, k_cache, v_cache, meta = _decode_batch([20, 5], 9, 3, 64, dtype=torch.float16)
    assert not CPUAttention.covers(q, k_cache)
    got = cpu_backend.decode(q, k_cache, v_cache, meta, 0.125)
    assert torch.equal(got, TorchAttention().decode(q, k_cache, v_cache, meta, 0.125))
    q, k_cache, *_ = _decode_batch([20], 9, 3, 96)
    assert not CPUAttention.covers(q, k_cache)
    q, k_cache, *_ = _decode_batch([20], 9, 3, 64)
    assert not CPUAttention.covers(q.bfloat16(), k_cache)  # mixed dtypes


def test_auto_picks_the_cpu_backend_on_a_cpu():
    assert resolve_backend_name("auto", torch.device("cpu")) == "cpu"
    with pytest.raises(ValueError, match="cpu"):
        resolve_backend_name("cpu", torch.device("cuda"))


def test_unbuildable_kernels_fall_back_to_torch(tmp_path):
    blocker = tmp_path / "kernels"
    blocker.write_text("a file where the build directory should go")
    assert load_cpu_kernels(blocker) is None
    assert isinstance(make_backend("cpu", None), TorchAttention)


def test_cpu_and_torch_backends_decode_the_same_tokens(make_tiny_engine):
    prompts = [list(range(3, 3 + n)) for n in (1, 18, 40)]
    params = {"temperature": 0, "max_tokens": 20, "ignore_eos": True}
    shape = {"head_dim": 64, "num_attention_heads": 4, "num_key_value_heads": 2}  # covered
    runs = {}
    for backend in ("cpu", "torch"):
        engine = make_tiny_engine(attention_backend=backend, checkpoint_kwargs=shape)
        assert engine.info.attention_backend == backend
        out = engine.generate_all([{"prompt_token_ids": p, "params": params} for p in prompts])
        runs[backend] = [output_ids(stream) for stream in out.values()]
    assert runs["cpu"] == runs["torch"]


@pytest.mark.parametrize("rows", [1, 5, 40])
def test_rms_norm_equals_the_torch_norm(cpu_kernels, rows):
    norm = RMSNorm(576, 1e-5)
    norm.weight.copy_(torch.randn(576))
    x = torch.randn(rows, 576) * 3
    expected = norm(x)
    norm.kernels = cpu_kernels
    torch.testing.assert_close(norm(x), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rows", [1, 5, 40])
def test_silu_and_mul_equals_torch(cpu_kernels, rows):
    gate_up = torch.randn(rows + 3, 2 * 1536) * 4
    gate_up = gate_up[:rows]  # a linear's padded output, sliced
    gate, up = gate_up.split(1536, dim=-1)
    torch.testing.assert_close(cpu_kernels.silu_and_mul(gate_up), F.silu(gate) * up,
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rows", [1, 5, 40])
def test_rotary_in_place_equals_transformers_rotation(cpu_kernels, rows):
    heads, kv_heads, head_dim = 9, 3, 64
    qkv = torch.randn(rows, heads + 2 * kv_heads, head_dim)
    angles = torch.rand(rows, head_dim // 2) * 100
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    expected = rotate(qkv[:, : heads + kv_heads], cos, sin)
    v = qkv[:, heads + kv_heads :].clone()
    cpu_kernels.rotary_(qkv, heads + kv_heads, cos, sin)
    torch.testing.assert_close(qkv[:, : heads + kv_heads], expected, rtol=1e-5, atol=1e-5)
    assert torch.equal(qkv[:, heads + kv_heads :], v), "v must stay as it is"


# bf16: the kernels round where transformers' bf16 ops round; where torch runs its AVX-512 or
# AVX2 kernels (the Sleef exp SiLU uses) they equal torch's bf16 ops bit for bit, on either of
# kvserve's instruction sets


@pytest.fixture(scope="module")
def bf16_elementwise(isa_kernels):
    assert elementwise_available_for(isa_kernels, torch.bfloat16)
    if torch.backends.cpu.get_cpu_capability() not in ("AVX512", "AVX2"):
        pytest.skip("bit-identical to torch where torch runs its AVX-512 or AVX2 kernels")
    return isa_kernels


@pytest.mark.parametrize("hidden", [576, 2048, 100, 17, 8])  # 100, 17: scalar tails of the sum
@pytest.mark.parametrize("rows", [1, 5, 40])
def test_bf16_rms_norm_is_the_torch_norm_bit_for_bit(bf16_elementwise, hidden, rows):
    """fp32 sum of squares in torch's own order, then bf16(x * rsqrt), then bf16(weight * that)."""
    gen = torch.Generator().manual_seed(hidden + rows)
    norm = RMSNorm(hidden, 1e-5).to(torch.bfloat16)
    norm.weight.copy_(torch.randn(hidden, generator=gen))
    x = (torch.randn(rows + 2, hidden, generator=gen) * 3).bfloat16()[:rows]  # strided rows
    expected = norm(x)
    norm.kernels = bf16_elementwise
    got = norm(x)
    assert got.dtype == torch.bfloat16 and torch.equal(got, expected)


@pytest.mark.parametrize(("inter", "rows"),
                         [(1536, 1), (1536, 40), (8192, 5), (100, 7), (120, 9)])
def test_bf16_silu_and_mul_is_torch_bit_for_bit(bf16_elementwise, inter, rows):
    """bf16(bf16(silu(gate)) * up); inter 100: torch's scalar tail (std::exp) past 96; 120:
    past 96 on torch's AVX-512 kernels (vectors of 32), past 112 on its AVX2 ones (16)."""
    gen = torch.Generator().manual_seed(inter + rows)
    gate_up = (torch.randn(rows + 3, 2 * inter, generator=gen) * 4).bfloat16()[:rows]
    gate, up = gate_up.split(inter, dim=-1)
    assert torch.equal(bf16_elementwise.silu_and_mul(gate_up), F.silu(gate) * up)


def test_bf16_silu_equals_torch_for_every_bf16_value(bf16_elementwise):
    """Every finite bf16 gate (up = 1): the exp and the division are torch's, not just close."""
    every = torch.arange(65536, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    gate = every[torch.isfinite(every)]
    gate = gate[: gate.numel() // 1536 * 1536].view(-1, 1536)
    got = bf16_elementwise.silu_and_mul(torch.cat([gate, torch.ones_like(gate)], -1))
    assert torch.equal(got, F.silu(gate))


@pytest.mark.parametrize("head_dim", [64, 128, 40])  # 40: the scalar tail of a half
@pytest.mark.parametrize("rows", [1, 5, 40])
def test_bf16_rotary_is_the_torch_rotation_bit_for_bit(bf16_elementwise, head_dim, rows):
    """bf16(bf16(x * cos) + bf16(rotate_half(x) * sin)), cos and sin in bf16 (as transformers)."""
    heads, kv_heads = 9, 3
    gen = torch.Generator().manual_seed(head_dim + rows)
    qkv = torch.randn(rows, heads + 2 * kv_heads, head_dim, generator=gen).bfloat16()
    angles = torch.rand(rows, head_dim // 2, generator=gen) * 100
    cos = torch.cat([angles.cos()] * 2, -1).bfloat16()
    sin = torch.cat([angles.sin()] * 2, -1).bfloat16()
    expected = rotate(qkv[:, : heads + kv_heads], cos, sin)
    v = qkv[:, heads + kv_heads :].clone()
    bf16_elementwise.rotary_(qkv, heads + kv_heads, cos, sin)
    assert torch.equal(qkv[:, : heads + kv_heads], expected)
    assert torch.equal(qkv[:, heads + kv_heads :], v), "v must stay as it is"


def test_bf16_elementwise_equal_torchs_avx2_kernels_too(tmp_path, cpu_kernels):
    """Where torch runs its AVX-512 kernels, the bf16 tests above compare against those; run
    them again with torch on its AVX2 kernels (ATEN_CPU_CAPABILITY, as on an AVX2-only CPU:
    Sleef's 8-lane exp, SiLU vectorized in groups of 16), on both of kvserve's instruction
    sets."""
    if torch.backends.cpu.get_cpu_capability() != "AVX512":
        pytest.skip("torch runs its AVX2 kernels here already: the tests above are this one")
    import os
    import subprocess

    env = {**os.environ, "ATEN_CPU_CAPABILITY": "avx2"}
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
         "-o", f"cache_dir={tmp_path}", __file__, "-k", "bf16_rms or bf16_silu or bf16_rotary"],
        env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    summary = done.stdout.strip().splitlines()[-1]
    assert "passed" in summary and "failed" not in summary, summary
    if cpu_kernels.linear_isa() == "avx512":  # (a build for an AVX2-only CPU skips AVX-512's)
        assert "skipped" not in summary, summary


def test_engine_uses_the_kernels_for_fp32_and_bf16_on_cpu(make_tiny_engine, cpu_kernels):
    """fp32 and bf16 (AVX2 or AVX-512) take the elementwise kernels and the `cpu` attention
    backend; fp16 takes none of the kernels."""
    fp32 = make_tiny_engine()
    assert fp32.model.layers[0].mlp.silu_and_mul is not None
    assert fp32.model.norm.kernels is not None
    bf16 = make_tiny_engine(dtype="bfloat16")
    assert bf16.info.attention_backend == "cpu"
    if cpu_kernels.bf16_linear_available():
        assert bf16.model.layers[0].mlp.silu_and_mul == cpu_kernels.silu_and_mul
        assert bf16.model.norm.kernels is cpu_kernels
        assert bf16.model.layers[0].mlp.down_proj.kernel is cpu_kernels.linear_bf16
    fp16 = make_tiny_engine(dtype="float16")
    assert fp16.model.layers[0].mlp.silu_and_mul is None
    assert fp16.model.layers[0].mlp.down_proj.kernel is None
    assert fp16.info.attention_backend == "torch"


def test_kernels_refuse_what_they_do_not_cover(cpu_kernels):
    with pytest.raises(RuntimeError, match="rms_norm"):
        cpu_kernels.rms_norm(torch.randn(2, 8, dtype=torch.float64), torch.ones(8), 1e-5)
    with pytest.raises(RuntimeError, match="rotary_"):
        cpu_kernels.rotary_(torch.randn(2, 3, 64), 3, torch.ones(1, 64), torch.ones(1, 64))
    with pytest.raises(RuntimeError, match="weight"):  # bf16 x, fp32 weight
        cpu_kernels.rms_norm(torch.randn(2, 8).bfloat16(), torch.ones(8), 1e-5)
    with pytest.raises(RuntimeError, match="cos, sin"):  # bf16 x, fp32 cos and sin
        cpu_kernels.rotary_(torch.randn(2, 3, 64).bfloat16(), 3, torch.ones(2, 64),
                            torch.ones(2, 64))
    q, k_cache, v_cache, meta = _decode_batch([5, 9], 9, 3, 64)
    with pytest.raises(RuntimeError, match="one block table"):
        cpu_kernels.paged_decode(q, k_cache, v_cache, meta.decode_block_tables[:1],
                                 meta.decode_context_lens, 0.125, 0, 0.0)
    with pytest.raises(RuntimeError, match="one dtype"):
        cpu_kernels.paged_decode(q.bfloat16(), k_cache, v_cache, meta.decode_block_tables,
                                 meta.decode_context_lens, 0.125, 0, 0.0)
    too_long = meta.decode_context_lens + 16 * meta.decode_block_tables.shape[1]
    with pytest.raises(RuntimeError, match="attends to"):
        cpu_kernels.paged_decode(q, k_cache, v_cache, meta.decode_block_tables, too_long, 0.125, 0,
                                 0.0)


@pytest.mark.parametrize(("vocab", "pad"), [(49152, 0), (1000, 24), (33, 0)])
def test_the_token_mask_sets_minus_inf_where_a_named_rows_bit_is_0(cpu_kernels, vocab, pad):
    """`apply_token_bitmask_` sets -inf exactly where a named row's bit is 0 (bit t % 32 of word
    t / 32, xgrammar's layout), on words all allowed, all forbidden and mixed, a vocabulary that
    is not a multiple of 32 (its last word partly used), and logits rows that are a strided view
    with padding past the vocabulary, which stays as it was; other rows are untouched. Where the
    vocabulary is a multiple of 32, xgrammar's own CPU apply gives the same logits (on the
    others xgrammar 0.2.9's writes -inf past the vocabulary, into the next row's first token,
    where the last word's padding bits are 0 and its last token is allowed)."""
    import xgrammar as xgr

    gen = torch.Generator().manual_seed(vocab)
    bitmask = torch.randint(-2**31, 2**31 - 1, (8, -(-vocab // 32)), dtype=torch.int32,
                            generator=gen)
    bitmask[1], bitmask[2], bitmask[3, ::2] = -1, 0, -1  # all allowed, none, half the words
    wide = torch.randn(8, vocab + pad + 5, generator=gen)
    logits, before = wide[:, :vocab + pad], wide.clone()
    rows = [0, 1, 2, 3, 6]
    bits = (bitmask.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1
    expected = before[:, :vocab + pad].clone()
    for r in rows:
        expected[r, :vocab][bits[r].flatten()[:vocab] == 0] = float("-inf")
    cpu_kernels.apply_token_bitmask_(logits, bitmask, torch.tensor(rows), vocab)
    assert torch.equal(logits, expected)
    assert torch.equal(wide[:, vocab + pad:], before[:, vocab + pad:])
    assert torch.isinf(logits[2, :vocab]).all() and torch.isfinite(logits[1]).all()
    if vocab % 32 == 0:
        theirs = before[:, :vocab + pad].clone()
        xgr.apply_token_bitmask_inplace(theirs, bitmask, vocab_size=vocab, indices=rows)
        assert torch.equal(logits, theirs)


def test_the_token_mask_refuses_rows_and_shapes_it_does_not_cover(cpu_kernels):
    logits, bitmask = torch.randn(2, 64), torch.full((2, 2), -1, dtype=torch.int32)
    with pytest.raises(RuntimeError, match="row 2 out of range"):
        cpu_kernels.apply_token_bitmask_(logits, bitmask, torch.tensor([0, 2]), 64)
    with pytest.raises(RuntimeError, match="vocab 65 beyond"):
        cpu_kernels.apply_token_bitmask_(logits, bitmask, torch.tensor([0]), 65)
    with pytest.raises(RuntimeError, match="int32"):
        cpu_kernels.apply_token_bitmask_(logits, bitmask.long(), torch.tensor([0]), 64)
    with pytest.raises(RuntimeError, match="fp32"):
        cpu_kernels.apply_token_bitmask_(logits.bfloat16(), bitmask, torch.tensor([0]), 64)


def test_a_killed_builds_lock_is_cleared_a_live_one_kept(tmp_path):
    assert not clear_stale_lock(tmp_path, now=1e9)  # no lock at all
    lock = tmp_path / "lock"
    lock.write_text("")
    mtime = lock.stat().st_mtime
    assert not clear_stale_lock(tmp_path, now=mtime + 30)  # a build in progress
    assert lock.exists()
    assert clear_stale_lock(tmp_path, now=mtime + STALE_LOCK_S + 1)
    assert not lock.exists()


def test_each_cpu_type_gets_its_own_build(monkeypatch, tmp_path):
    """-march=native builds must not be shared between CPUs of a cluster with one home dir,
    nor with a build for another CPU (KVSERVE_KERNELS_MARCH)."""
    from kvserve.workers.model_executor.cpu_kernels import MARCH_ENV, kernel_build_dir

    monkeypatch.delenv(MARCH_ENV, raising=False)
    native = kernel_build_dir(tmp_path)
    monkeypatch.setenv(MARCH_ENV, "znver2")
    assert kernel_build_dir(tmp_path) != native
    monkeypatch.setenv(MARCH_ENV, "native")
    assert kernel_build_dir(tmp_path) == native
    avx512 = build_dir_name("2.13.0+cpu", "model name: EPYC\nflags: avx2 avx512f")
    avx2 = build_dir_name("2.13.0+cpu", "model name: Xeon\nflags: avx2")
    assert avx512 != avx2
    assert avx512 == build_dir_name("2.13.0+cpu", "model name: EPYC\nflags: avx2 avx512f")
    assert avx512.startswith("torch-2.13.0_cpu-py") and "+" not in avx512
    features = cpu_features()
    assert features
    if sys.platform.startswith("linux"):  # from /proc/cpuinfo: the flags say AVX-512 or not
        assert "flags" in features and "model name" in features


def test_bf16_is_said_to_crawl_only_where_the_kernels_cannot_run_it(monkeypatch, cpu_kernels):
    """dtype bfloat16 on a CPU without AVX512-BF16/AMX-BF16 (an AVX2-only EPYC: torch's bf16
    matmuls at ~1-2 GFLOP/s against fp32's ~150) runs kvserve's kernels at about fp32's speed
    (fp32 multiply-adds), so nothing is said; where they cannot run (no AVX2, or
    KVSERVE_CPU_ISA=none) the engine says why bf16 is slow and what to use. The flags are read
    from /proc/cpuinfo's text."""
    from kvserve.workers.model_executor import cpu_kernels as module

    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    assert module.native_bf16("flags\t: fpu avx2 avx512f avx512_bf16\n")
    assert module.native_bf16("flags\t: fpu avx2 amx_bf16 amx_tile\n")
    assert module.native_bf16("Features\t: fp asimd bf16 i8mm\n")  # Arm
    assert not module.native_bf16("flags\t: fpu sse4_2 avx2 fma\n")
    for cap, native in (("AVX2", False), ("AVX512_CORE", False), ("AVX512_CORE_BF16", True)):
        monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", cap)  # oneDNN capped below bf16, or not
        assert module.native_bf16("flags\t: fpu avx2 avx512f avx512_bf16\n") is native, cap
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA")
    no_bf16 = "model name\t: AMD EPYC\nflags\t: fpu avx2 fma\n"
    try:
        for isa in ("avx2", "avx512"):
            try:
                cpu_kernels.set_linear_isa(isa)
            except RuntimeError:  # not built (a build for an AVX2-only CPU), not on this CPU
                continue
            for dtype in (torch.bfloat16, torch.float32):
                assert module.fallback_note(cpu_kernels, dtype, no_bf16) is None
        monkeypatch.setenv(module.ISA_ENV, "none")
        cpu_kernels.set_linear_isa("none")
        note = module.fallback_note(cpu_kernels, torch.bfloat16, no_bf16)
        assert "KVSERVE_CPU_ISA=none" in note and "dtype float32 (or auto) is faster" in note
        note = module.fallback_note(cpu_kernels, torch.float32, no_bf16)
        assert "oneDNN" in note and "faster" not in note
        with_bf16 = no_bf16.replace("fma", "fma avx512_bf16")
        assert "faster" not in module.fallback_note(cpu_kernels, torch.bfloat16, with_bf16)
        # no kernels at all (load_cpu_kernels said why): only bf16's speed is left to say
        assert module.fallback_note(None, torch.float32, no_bf16) is None
        assert "is faster" in module.fallback_note(None, torch.bfloat16, no_bf16)
    finally:
        cpu_kernels.set_linear_isa("")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_cpu_with_neither_isa_runs_torchs_ops_and_says_so_once(make_tiny_engine, cpu_kernels,
                                                                 monkeypatch, caplog, dtype):
    """KVSERVE_CPU_ISA=none runs what a CPU with neither AVX2 nor AVX-512 (Arm's) runs: no
    kvserve projection, no one-call decode layer, no bf16 elementwise kernel, one warning at the
    start; the tokens are the kernels' own (fp32: the greedy suite's exactness; bf16: the
    same tokens on this tiny model). Negative control: without it the kernels run, unsaid."""
    from kvserve.workers import builder
    from kvserve.workers.model_executor.cpu_kernels import ISA_ENV
    from kvserve.workers.model_executor.model import onednn_available

    prompts = [list(range(3, 3 + n)) for n in (1, 18, 40)]
    params = {"temperature": 0, "max_tokens": 12, "ignore_eos": True}
    shape = {"head_dim": 64, "num_attention_heads": 4, "num_key_value_heads": 2}  # covered

    def run():
        caplog.clear()
        with caplog.at_level("WARNING", logger=builder.__name__):
            engine = make_tiny_engine(dtype=dtype, checkpoint_kwargs=shape)
        said = [r.getMessage() for r in caplog.records if r.name == builder.__name__]
        out = engine.generate_all([{"prompt_token_ids": p, "params": params} for p in prompts])
        return engine, [output_ids(stream) for stream in out.values()], said

    kernel_engine, kernel_tokens, said = run()
    down = kernel_engine.model.layers[0].mlp.down_proj
    assert down.kernel is not None and kernel_engine.model.decode_kernels is cpu_kernels
    assert said == []
    monkeypatch.setenv(ISA_ENV, "none")
    try:
        engine, tokens, said = run()
        assert cpu_kernels.linear_isa() == "" and not cpu_kernels.linear_available()
        assert len(said) == 1 and "KVSERVE_CPU_ISA=none" in said[0], said
        model = engine.model
        assert model.layers[0].mlp.down_proj.kernel is None
        assert model.decode_kernels is None  # oneDNN where it runs the dtype, else F.linear
        assert model.layers[0].mlp.down_proj.use_onednn == onednn_available(getattr(torch, dtype))
        assert (model.norm.kernels is None) == (dtype == "bfloat16")  # fp32's need no ISA
        assert tokens == kernel_tokens
    finally:
        cpu_kernels.set_linear_isa("")
    with pytest.raises(ValueError, match="KVSERVE_CPU_ISA must be one of avx512, avx2, none"):
        monkeypatch.setenv(ISA_ENV, "sse2")
        make_tiny_engine(dtype=dtype, checkpoint_kwargs=shape)
