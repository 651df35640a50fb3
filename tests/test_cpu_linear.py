"""kvserve's CPU projection kernel (`linear`) and the one-call decode layer (`decode_layer`)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from workers.attention import make_backend
from workers.attention import metadata as attention_metadata
from workers.bench.baselines import (
    decode_step_weights,
    weight_bytes_per_decode_step,
    weights_read_seconds,
)
from workers.engine import _build_model
from workers.model import Linear
from workers.tiny import tiny_checkpoint


@pytest.fixture(scope="module")
def kernels(cpu_kernels):
    if not cpu_kernels.linear_available():
        pytest.skip("linear needs AVX-512")
    return cpu_kernels


@pytest.mark.parametrize(("n", "k"), [(48, 64), (50, 7), (960, 576), (130, 1536)])
@pytest.mark.parametrize("rows", [0, 1, 7, 8, 9, 33])
def test_linear_equals_f_linear(kernels, n, k, rows):
    gen = torch.Generator().manual_seed(n * k + rows)
    w, b = torch.randn(n, k, generator=gen), torch.randn(n, generator=gen)
    x = torch.randn(rows, k, generator=gen)
    packed = kernels.pack_linear_weight(w)
    assert packed.shape == (-(-n // 48), k, 48)
    torch.testing.assert_close(kernels.linear(x, packed, n, b), F.linear(x, w, b),
                               rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(kernels.linear(x, packed, n, None), F.linear(x, w),
                               rtol=1e-4, atol=1e-4)


def test_a_rows_numbers_do_not_depend_on_the_batch(kernels):
    """Bit-identical whatever the row count and wherever the row falls in a tile."""
    gen = torch.Generator().manual_seed(0)
    w, x = torch.randn(200, 576, generator=gen), torch.randn(40, 576, generator=gen)
    packed = kernels.pack_linear_weight(w)
    full = kernels.linear(x, packed, 200, None)
    for rows in (1, 2, 5, 8, 13, 31):
        for start in range(0, 40 - rows + 1, 3):
            part = kernels.linear(x[start:start + rows], packed, 200, None)
            assert torch.equal(part, full[start:start + rows]), (rows, start)


def test_linear_reads_strided_rows(kernels):
    wide = torch.randn(6, 100)
    x = wide[:, :64]  # rows strided by 100
    w = torch.randn(96, 64)
    got = kernels.linear(x, kernels.pack_linear_weight(w), 96, None)
    assert torch.equal(got, kernels.linear(x.contiguous(), kernels.pack_linear_weight(w), 96, None))


def test_linear_refuses_what_it_does_not_cover(kernels):
    packed = kernels.pack_linear_weight(torch.randn(60, 32))
    with pytest.raises(RuntimeError, match="fp32 x"):
        kernels.linear(torch.randn(2, 32, dtype=torch.float64), packed, 60, None)
    with pytest.raises(RuntimeError, match="K = 31"):
        kernels.linear(torch.randn(2, 31), packed, 60, None)
    with pytest.raises(RuntimeError, match="for 200 outputs"):
        kernels.linear(torch.randn(2, 32), packed, 200, None)
    with pytest.raises(RuntimeError, match="bias"):
        kernels.linear(torch.randn(2, 32), packed, 60, torch.randn(59))
    misaligned = torch.empty(packed.numel() + 4)[4:].view(packed.shape)  # 16 bytes in
    misaligned.copy_(packed)
    with pytest.raises(RuntimeError, match="64-byte"):
        kernels.linear(torch.randn(2, 32), misaligned, 60, None)


def test_linear_module_packs_for_the_kernels(kernels):
    lin = Linear(64, 100, bias=True)
    x = torch.randn(5, 64)
    expected = lin(x)
    lin.pack_for_kernels(kernels)
    assert lin.kernels is kernels and lin.weight.shape == (3, 64, 48)
    torch.testing.assert_close(lin(x), expected, rtol=1e-5, atol=1e-5)


# head_dim 64: a shape the `cpu` attention backend covers, so decode-only steps take decode_layer
COVERED = {"head_dim": 64, "num_attention_heads": 4, "num_key_value_heads": 2}


def _decode_step(model, lengths: list[int], block_size: int = 16):
    """A decode-only step over random caches: (input_ids, cos, sin, kv_cache, meta)."""
    gen = torch.Generator().manual_seed(len(lengths))
    cfg, layers = model.config, len(model.layers)
    shape = (64, block_size, cfg.num_key_value_heads, 64)
    kv_cache = [(torch.randn(shape, generator=gen), torch.randn(shape, generator=gen))
                for _ in range(layers)]
    pool = torch.randperm(64, generator=gen).tolist()
    tables = [[pool.pop() for _ in range(-(-n // block_size))] for n in lengths]
    slots = [t[(n - 1) // block_size] * block_size + (n - 1) % block_size
             for t, n in zip(tables, lengths, strict=True)]
    meta, _ = attention_metadata.build(
        torch.device("cpu"), slots, decodes=list(zip(tables, lengths, strict=True)), prefills=[],
        block_size=block_size)
    angles = torch.rand(len(lengths), 32, generator=gen) * 50
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    ids = torch.randint(100, cfg.vocab_size, (len(lengths),), generator=gen)
    return ids, cos, sin, kv_cache, meta


@pytest.mark.parametrize("model_type", ["llama", "qwen2"])  # qwen2: q/k/v biases
def test_decode_layer_is_bit_identical_to_the_python_layers(kernels, model_type):
    model = _build_model(tiny_checkpoint(model_type, **COVERED), torch.device("cpu"),
                         torch.float32, kernels)
    assert model.decode_kernels is kernels
    backend = make_backend("cpu", kernels)
    ids, cos, sin, kv_cache, meta = _decode_step(model, [1, 17, 40, 16])
    fused_cache = [(k.clone(), v.clone()) for k, v in kv_cache]
    with torch.inference_mode():
        fused = model(ids, cos, sin, fused_cache, meta, backend)
        model.decode_kernels = None  # the Python layers, same kernels op by op
        python = model(ids, cos, sin, kv_cache, meta, backend)
    assert torch.equal(fused, python)
    for (fk, fv), (k, v) in zip(fused_cache, kv_cache, strict=True):
        assert torch.equal(fk, k) and torch.equal(fv, v), "the same K/V written to the cache"


def test_decode_layer_only_where_the_cpu_backend_covers_the_shapes(kernels):
    uncovered = _build_model(tiny_checkpoint(), torch.device("cpu"), torch.float32, kernels)
    assert uncovered.decode_kernels is None  # head_dim 16
    covered = _build_model(tiny_checkpoint(**COVERED), torch.device("cpu"), torch.float32, kernels)
    assert covered.lm_head.kernels is kernels
    assert covered.lm_head.weight.data_ptr() != covered.embed_tokens.weight.data_ptr()


def test_a_decode_step_reads_every_weight_once_and_no_embedding(kernels):
    model = _build_model(tiny_checkpoint(**COVERED), torch.device("cpu"), torch.float32, kernels)
    ids = {id(t) for t in decode_step_weights(model)}
    assert id(model.embed_tokens.weight) not in ids
    assert id(model.lm_head.weight) in ids  # tied, but packed into its own copy
    expected = sum(p.numel() * 4 for name, p in model.named_parameters() if "embed" not in name)
    assert weight_bytes_per_decode_step(model) == expected
    assert weights_read_seconds(model, repeats=2) > 0
