"""The triton attention backend's kernels
(kvserve/workers/model_executor/attention/triton_kernels.py)
against the torch backend's SDPA, on small shapes: without a GPU under Triton's interpreter
(tests/conftest.py), on CUDA compiled. fp32 and fp16 everywhere, bf16 on CUDA only: the
interpreter's bf16 tl.dot is wrong, so the bf16 tensor-core path is the device check's.

What is claimed, each with a control that shows the comparison can fail:
- equal to the reference (tolerance) for decodes, prefill chunks over a cached prefix, mixed
  steps, GQA groups of 1, 4 and 8, block tables with holes and shared prefix blocks, block
  sizes that are not powers of two, contexts crossing block and split boundaries;
- bit-identical rows whatever else is in the batch and however a prompt is chunked;
- a padding row (context 0) reads nothing and gives zeros;
- launch grids that depend on the batch's shape, never on context lengths.
"""

from __future__ import annotations

import random

import pytest
import torch

pytest.importorskip("triton")
pytestmark = pytest.mark.triton

from kvserve.workers.model_executor.attention import metadata as attention_metadata  # noqa: E402
from kvserve.workers.model_executor.attention import triton_kernels  # noqa: E402
from kvserve.workers.model_executor.attention.torch_backend import TorchAttention, write_kv  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
TOL = {torch.float32: 2e-5, torch.float16: 5e-3, torch.bfloat16: 3e-2}  # vs fp32 SDPA
# bf16's tensor-core dots only where they are right: compiled on a GPU
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE.type == "cuda" else [])
HEAD_DIM = 32
SCALE = HEAD_DIM**-0.5


class Step:
    """One step's queries, K/V (written to a random pool) and metadata, as the runner builds
    them: decodes (table, context) first, then prefill chunks (table, q_len, context)."""

    def __init__(self, decodes, prefills, heads=4, kv_heads=2, block_size=16, num_blocks=96,
                 dtype=torch.float32, seed=0, pool=None):
        gen = torch.Generator().manual_seed(seed)
        shape = (num_blocks, block_size, kv_heads, HEAD_DIM)
        if pool is None:
            pool = (torch.randn(shape, generator=gen), torch.randn(shape, generator=gen))
        self.k_cache, self.v_cache = (p.to(DEVICE, dtype, copy=True) for p in pool)
        slots = []
        for table, ctx in decodes:
            slots.append(_slot(table, ctx - 1, block_size))
        for table, q_len, ctx in prefills:
            slots += [_slot(table, p, block_size) for p in range(ctx - q_len, ctx)]
        self.meta, _ = attention_metadata.build(DEVICE, slots, decodes, prefills, block_size)
        tokens = len(slots)
        self.q = torch.randn(tokens, heads, HEAD_DIM, generator=gen).to(DEVICE, dtype)
        self.k = torch.randn(tokens, kv_heads, HEAD_DIM, generator=gen).to(DEVICE, dtype)
        self.v = torch.randn(tokens, kv_heads, HEAD_DIM, generator=gen).to(DEVICE, dtype)
        write_kv(self.k, self.v, self.k_cache, self.v_cache, self.meta.slot_mapping)

    def triton(self, meta=None, window: int = 0) -> torch.Tensor:
        m = meta or self.meta
        return triton_kernels.paged_attention(
            self.q, self.k_cache, self.v_cache, m.block_tables, m.seq_lens, m.query_start_loc,
            m.num_decodes, SCALE, dot_fp32=False, window=window)

    def reference(self, window: int = 0) -> torch.Tensor:
        # fp32 SDPA over the same cache: the reference the torch backend serves with
        f32 = [t.float() for t in (self.q, self.k, self.v, self.k_cache, self.v_cache)]
        return TorchAttention().attend(*f32, self.meta, SCALE, window).to(self.q.dtype)


def _slot(table, position, block_size):
    return table[position // block_size] * block_size + position % block_size


def _tables(lengths, block_size, num_blocks, seed=0):
    """A block table per length, from shuffled blocks: holes and out-of-order blocks."""
    blocks = list(range(num_blocks))
    random.Random(seed).shuffle(blocks)
    tables, at = [], 0
    for n in lengths:
        need = -(-n // block_size)
        tables.append(blocks[at:at + need])
        at += need
    assert at <= num_blocks
    return tables


def _assert_close(step: Step, out: torch.Tensor | None = None) -> None:
    out = step.triton() if out is None else out
    ref = step.reference()
    tol = TOL[step.q.dtype]
    torch.testing.assert_close(out, ref, rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("heads, kv_heads", [(2, 2), (8, 2), (8, 1)], ids=["mha", "gqa4", "gqa8"])
def test_a_mixed_step_equals_the_reference(heads, kv_heads, dtype):
    """Decodes crossing block and split boundaries (16, 17, 257 and 600 keys: 1, 1, 2 and 3
    splits) beside a whole prompt and a later chunk over its cached prefix."""
    lens = [16, 17, 257, 600, 40, 100]
    tables = _tables(lens, 16, 96)
    decodes = list(zip(tables[:4], lens[:4], strict=True))
    prefills = [(tables[4], 40, 40), (tables[5], 30, 100)]
    _assert_close(Step(decodes, prefills, heads, kv_heads, dtype=dtype))


@pytest.mark.parametrize("block_size", [1, 5, 16, 256])
def test_any_block_size_works(block_size):
    lens = [3, 70, 300]
    num_blocks = sum(-(-n // block_size) for n in lens) + 4
    tables = _tables(lens, block_size, num_blocks, seed=block_size)
    step = Step([(tables[0], 3), (tables[2], 300)], [(tables[1], 20, 70)], heads=4, kv_heads=2,
                block_size=block_size, num_blocks=num_blocks)
    _assert_close(step)


def test_shared_prefix_blocks_are_read_by_both_sequences():
    """Two requests share their first three blocks (a prefix-cache hit) and differ after."""
    shared = [7, 2, 9]
    step = Step([(shared + [4], 60), (shared + [11, 12], 80)], [(shared + [20], 10, 55)])
    _assert_close(step)


def test_contexts_past_the_split_cap_equal_the_reference():
    """4,200 keys need more than MAX_SPLITS pieces of 256: the pieces grow instead."""
    n = 4200
    assert -(-n // triton_kernels.SPLIT_MIN_TOKENS) > triton_kernels.MAX_SPLITS
    table = _tables([n], 64, 70)[0]
    _assert_close(Step([(table, n)], [], heads=2, kv_heads=1, block_size=64, num_blocks=70))


def test_the_reference_comparison_catches_wrong_block_tables():
    """Negative control: the same step with two decodes' block tables swapped fails."""
    lens = [50, 80]
    tables = _tables(lens, 16, 16)
    step = Step(list(zip(tables, lens, strict=True)), [], num_blocks=16)
    swapped = step.meta.block_tables[[1, 0]].contiguous()
    bad = triton_kernels.paged_attention(
        step.q, step.k_cache, step.v_cache, swapped, step.meta.seq_lens,
        step.meta.query_start_loc, 2, SCALE)
    with pytest.raises(AssertionError):
        _assert_close(step, bad)


def test_a_decode_is_bit_identical_alone_and_in_any_batch():
    """The same request (table, 700 keys: 3 splits) decoded alone, with short neighbours and
    with a long one, and beside prefill chunks: its row never changes by a bit."""
    lens = [700, 20, 5000, 33, 64]
    tables = _tables(lens, 16, 400)
    pool = (torch.randn(400, 16, 2, HEAD_DIM), torch.randn(400, 16, 2, HEAD_DIM))
    target = (tables[0], 700)

    def row_of_target(decodes, prefills, row):
        step = Step(decodes, prefills, num_blocks=400, pool=pool)
        step.k_cache.copy_(pool[0])  # the same keys for the target in every batch
        step.v_cache.copy_(pool[1])
        q = torch.randn(1, 4, HEAD_DIM, generator=torch.Generator().manual_seed(9)).to(DEVICE)
        step.q[row] = q[0]  # the target's query, wherever it sits
        return step.triton()[row]

    alone = row_of_target([target], [], 0)
    assert torch.equal(alone, row_of_target([(tables[1], 20), target], [], 1))
    assert torch.equal(alone, row_of_target([(tables[2], 5000), (tables[3], 33), target], [], 2))
    assert torch.equal(alone, row_of_target([target, (tables[1], 20)],
                                            [(tables[4], 64, 64), (tables[3], 10, 33)], 0))


def test_a_different_split_rule_changes_the_bits(monkeypatch):
    """Negative control of the test above: had the split count depended on anything else
    (the batch, say), bitwise comparison would see it: 700 keys split 3 ways vs 1 way."""
    table = _tables([700], 16, 50)[0]
    step = Step([(table, 700)], [], num_blocks=50)
    three = step.triton()
    monkeypatch.setattr(triton_kernels, "SPLIT_MIN_TOKENS", 1024)
    one = step.triton()
    torch.testing.assert_close(one, three, rtol=1e-5, atol=1e-5)
    assert not torch.equal(one, three)


@pytest.mark.parametrize("window", [0, 37])
def test_a_prompts_rows_do_not_depend_on_its_chunking(window):
    """A 150-token prompt attended as one chunk, and as chunks of 64 + 86 (the second over the
    cached first): every row bit-identical, with a sliding window too."""
    table = _tables([150], 16, 12)[0]
    pool = (torch.randn(12, 16, 2, HEAD_DIM), torch.randn(12, 16, 2, HEAD_DIM))
    whole = Step([], [(table, 150, 150)], num_blocks=12, pool=pool, seed=3)
    first = Step([], [(table, 64, 64)], num_blocks=12, pool=pool, seed=3)
    second = Step([(table, 30)], [(table, 86, 150)], num_blocks=12, pool=pool, seed=3)
    for step in (first, second):  # same queries and keys as the whole prompt's
        step.k_cache.copy_(whole.k_cache)
        step.v_cache.copy_(whole.v_cache)
    first.q.copy_(whole.q[:64])
    second.q[1:] = whole.q[64:]
    out = whole.triton(window=window)
    assert torch.equal(first.triton(window=window), out[:64])
    assert torch.equal(second.triton(window=window)[1:], out[64:])


@pytest.mark.parametrize("window", [1, 37, 300])
def test_a_sliding_window_equals_the_reference_and_reads_no_block_before_it(window):
    """Decodes of 17, 257, 600 and 700 keys (the last ones split over the window, not the
    context) and prefill chunks over a cached prefix, each query seeing its last `window`
    keys: the reference's windowed mask. Then every block wholly before a sequence's first
    window, filled with NaN (freed, maybe reused), changes no bit. Negative control: without
    the window the output is another."""
    lens = [17, 257, 600, 700, 40, 100]
    tables = _tables(lens, 16, 120)
    decodes = list(zip(tables[:4], lens[:4], strict=True))
    prefills = [(tables[4], 40, 40), (tables[5], 30, 100)]
    step = Step(decodes, prefills, num_blocks=120)
    out = step.triton(window=window)
    torch.testing.assert_close(out, step.reference(window), rtol=2e-5, atol=2e-5)
    assert not torch.allclose(step.triton(), out, rtol=1e-3, atol=1e-3)
    first_rows = [n - 1 for n in lens[:4]] + [0, 70]  # each sequence's first query position
    for table, first in zip(tables, first_rows, strict=True):
        for b in table[:max(0, first - window + 1) // 16]:
            step.k_cache[b] = step.v_cache[b] = float("nan")
    assert torch.equal(step.triton(window=window), out)


@pytest.mark.parametrize("window", [0, 37])
def test_a_soft_cap_equals_the_reference(window):
    """Gemma 2's soft-capped scores (cap * tanh(score / cap)) in a mixed step, with and without
    a window: the torch backend's eager steps. Negative control: uncapped differs."""
    lens = [17, 600, 40, 100]
    tables = _tables(lens, 16, 60)
    step = Step(list(zip(tables[:2], lens[:2], strict=True)),
                [(tables[2], 40, 40), (tables[3], 30, 100)], num_blocks=60, seed=4)
    step.q.mul_(4)  # scores of a few units, which a cap of 1.5 bends
    out = triton_kernels.paged_attention(
        step.q, step.k_cache, step.v_cache, step.meta.block_tables, step.meta.seq_lens,
        step.meta.query_start_loc, step.meta.num_decodes, SCALE, window=window, softcap=1.5)
    f32 = [t.float() for t in (step.q, step.k, step.v, step.k_cache, step.v_cache)]
    ref = TorchAttention().attend(*f32, step.meta, SCALE, window, 1.5)
    torch.testing.assert_close(out, ref, rtol=2e-5, atol=2e-5)
    assert not torch.allclose(step.triton(window=window), out, rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_head_dim_256_tiles_equal_the_reference(monkeypatch, dtype):
    """Gemma's head dim 256 takes tiles of its own (narrower key tiles; 16 x 16 in fp32): a
    mixed step with a window and a soft-cap, as Gemma 2's local layers run it."""
    monkeypatch.setitem(globals(), "HEAD_DIM", 256)  # Step's q, k, v and caches
    lens = [17, 300, 40, 100]
    tables = _tables(lens, 16, 40)
    step = Step(list(zip(tables[:2], lens[:2], strict=True)),
                [(tables[2], 40, 40), (tables[3], 30, 100)], num_blocks=40, dtype=dtype)
    assert step.q.shape[-1] == 256
    out = triton_kernels.paged_attention(
        step.q, step.k_cache, step.v_cache, step.meta.block_tables, step.meta.seq_lens,
        step.meta.query_start_loc, step.meta.num_decodes, SCALE, window=64, softcap=20.0)
    f32 = [t.float() for t in (step.q, step.k, step.v, step.k_cache, step.v_cache)]
    ref = TorchAttention().attend(*f32, step.meta, SCALE, 64, 20.0).to(dtype)
    torch.testing.assert_close(out, ref, rtol=TOL[dtype], atol=TOL[dtype])


def test_a_padding_row_reads_nothing_and_gives_zeros():
    """A CUDA-graph batch's padding row: context 0 (and block 0 in its table). Its output is
    zeros, finite, and the real rows equal what they are without it."""
    lens = [90, 40]
    tables = _tables(lens, 16, 16)
    step = Step(list(zip(tables, lens, strict=True)) + [([0], 1)], [], num_blocks=16)
    step.meta.seq_lens[2] = 0
    out = step.triton()
    assert torch.equal(out[2], torch.zeros_like(out[2]))
    alone = Step(list(zip(tables, lens, strict=True)), [], num_blocks=16)
    alone.q.copy_(step.q[:2])
    alone.k_cache.copy_(step.k_cache)
    alone.v_cache.copy_(step.v_cache)
    assert torch.equal(out[:2], alone.triton())


def test_launch_grids_depend_on_the_batch_shape_not_the_lengths(monkeypatch):
    """What lets a decode step live in a CUDA graph: the same batch shape with other context
    lengths launches the same grids (lengths and split counts come from device memory). Only
    an eager step, whose host knows its longest context, trims the split axis to it."""
    grids: list[tuple] = []

    class Recording:
        def __init__(self, kernel):
            self.kernel = kernel

        def __getitem__(self, grid):
            grids.append(grid)
            return self.kernel[grid]

    for name in ("_attention_kernel", "_reduce_kernel"):
        monkeypatch.setattr(triton_kernels, name, Recording(getattr(triton_kernels, name)))
    runs, eager = [], []
    for lens in ([10, 20, 30], [900, 17, 2000]):
        tables = _tables(lens, 16, 200)
        step = Step(list(zip(tables, lens, strict=True)), [], num_blocks=200)
        grids.clear()
        graphed = step.triton()  # as in a graph: no host-side maximum
        runs.append(list(grids))
        grids.clear()
        trimmed = triton_kernels.paged_attention(
            step.q, step.k_cache, step.v_cache, step.meta.block_tables, step.meta.seq_lens,
            step.meta.query_start_loc, 3, SCALE, max_decode_context=max(lens))
        eager.append(grids[0])
        assert torch.equal(trimmed, graphed)
    assert runs[0] == runs[1]
    assert runs[0][0] == (3, 2, triton_kernels.MAX_SPLITS)
    assert eager == [(3, 2, 1), (3, 2, triton_kernels.num_splits(2000))]


def test_num_splits_is_a_function_of_the_length_alone():
    m = triton_kernels.SPLIT_MIN_TOKENS
    assert [triton_kernels.num_splits(n) for n in (0, 1, m, m + 1, 3 * m, 10**6)] == [
        1, 1, 1, 2, 3, triton_kernels.MAX_SPLITS]
