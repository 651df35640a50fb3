"""The CPU backend's C++ decode kernel against the torch path (gather + SDPA), and its fallbacks."""

from __future__ import annotations

import pytest
import torch

from tests.helpers import output_ids
from workers.attention import make_backend, resolve_backend_name
from workers.attention.cpu_backend import CPUAttention
from workers.attention.metadata import AttentionMetadata
from workers.attention.torch_backend import TorchAttention
from workers.loader import cache_root


@pytest.fixture(scope="module")
def cpu_backend() -> CPUAttention:
    backend = make_backend("cpu", cache_root() / "kernels")
    assert isinstance(backend, CPUAttention), "the kernel must build on this machine"
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
    tables = torch.zeros(len(lengths), max(blocks), dtype=torch.int32)
    for i, n in enumerate(blocks):
        tables[i, :n] = torch.tensor([pool.pop() for _ in range(n)])
    # q as the model makes it: a slice of a wider qkv row, so rows are strided
    qkv = torch.randn(len(lengths), heads + 2 * kv_heads, head_dim, generator=gen).to(dtype)
    q = qkv[:, :heads]
    lens = torch.tensor(lengths, dtype=torch.int32)
    keys = torch.arange(max(lengths))
    mask = (keys[None, :] < lens[:, None])[:, None, None, :]
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(0, dtype=torch.long), num_decodes=len(lengths),
        decode_block_tables=tables, decode_context_lens=lens,
        decode_mask=None if len(set(lengths)) == 1 else mask, prefills=[],
        cu_seqlens_q=torch.zeros(1, dtype=torch.int32),
        cu_seqlens_k=torch.zeros(1, dtype=torch.int32),
        prefill_block_tables=torch.zeros(0, 0, dtype=torch.int32))
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


def test_a_sequence_reads_only_its_own_blocks(cpu_backend):
    """Isolation: scribbling over every block outside a sequence's table changes nothing."""
    q, k_cache, v_cache, meta = _decode_batch([40, 7], 9, 3, 64)
    before = cpu_backend.decode(q, k_cache, v_cache, meta, 0.125)
    used = set(meta.decode_block_tables[0, :3].tolist()) | {meta.decode_block_tables[1, 0].item()}
    others = [b for b in range(k_cache.shape[0]) if b not in used]
    k_cache[others] = 1e4
    v_cache[others] = -1e4
    assert torch.equal(cpu_backend.decode(q, k_cache, v_cache, meta, 0.125), before)


def test_uncovered_dtypes_and_shapes_take_the_torch_path(cpu_backend):
    q, k_cache, v_cache, meta = _decode_batch([20, 5], 9, 3, 64, dtype=torch.bfloat16)
    assert not CPUAttention.covers(q, k_cache)
    got = cpu_backend.decode(q, k_cache, v_cache, meta, 0.125)
    assert torch.equal(got, TorchAttention().decode(q, k_cache, v_cache, meta, 0.125))
    q, k_cache, *_ = _decode_batch([20], 9, 3, 96)
    assert not CPUAttention.covers(q, k_cache)


def test_auto_picks_the_cpu_backend_on_a_cpu():
    assert resolve_backend_name("auto", torch.device("cpu")) == "cpu"
    with pytest.raises(ValueError, match="cpu"):
        resolve_backend_name("cpu", torch.device("cuda"))


def test_unbuildable_kernel_falls_back_to_torch(tmp_path):
    blocker = tmp_path / "kernels"
    blocker.write_text("a file where the build directory should go")
    assert isinstance(make_backend("cpu", blocker), TorchAttention)


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
