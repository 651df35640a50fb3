"""oneDNN matmuls run at a few dozen row counts (padded), so a replica's memory stops growing
once it has seen them: oneDNN keeps memory per row count it has run (see `model_executor.model`)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvserve.workers.model_executor.model import Linear, onednn_available, padded_rows

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.skipif(not onednn_available(), reason="oneDNN linear not in this torch")

GROWTH = """
import sys, psutil, torch
from kvserve.workers.model_executor.model import Linear
torch.set_num_threads(1)
lin = Linear(576, 3072, bias=False)
lin.pack_for_onednn()
lin(torch.randn(1, 576))
before = psutil.Process().memory_info().rss
for rows in range(1, 513):  # every token count a 512-token step budget allows
    lin(torch.randn(rows, 576))
print((psutil.Process().memory_info().rss - before) / 2**20)
"""


def test_padded_rows_are_few_and_waste_little():
    assert [padded_rows(r) for r in (1, 7, 16, 17, 18, 33, 100, 512, 513)] == [
        1, 7, 16, 18, 18, 36, 104, 512, 576]
    assert len({padded_rows(r) for r in range(1, 513)}) == 56
    assert len({padded_rows(r) for r in range(1, 8193)}) == 88
    assert all(r <= padded_rows(r) <= r * 1.125 for r in range(1, 20000))


def test_padded_onednn_linear_equals_f_linear_on_the_real_rows():
    lin = Linear(64, 48, bias=True)
    x = torch.randn(37, 64)  # padded to 40
    expected = lin(x)
    lin.pack_for_onednn()
    got = lin(x)
    assert got.shape == (37, 48)
    torch.testing.assert_close(got, expected)


def test_memory_stays_flat_across_every_row_count_of_a_step_budget():
    """Unpadded, this grew RSS by ~350 MB for this one weight shape (torch 2.13, oneDNN)."""
    done = subprocess.run([sys.executable, "-c", GROWTH], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    growth_mib = float(done.stdout.split()[-1])
    assert growth_mib < 120, f"RSS grew {growth_mib:.0f} MiB over 512 row counts"


def test_the_weights_read_bound_reads_onednn_packed_weights():
    """Without kvserve's AVX-512 kernels (an AVX2-only CPU) the projections are oneDNN-packed
    tensors, which have no `sum()`: the batch-1 bandwidth bound of `kvserve bench throughput`,
    `bench speculative` and `bench structured` still reads their bytes. Negative control:
    summing the packed weight itself raises NotImplementedError."""
    from kvserve.bench.baselines import weight_bytes_per_decode_step, weights_read_seconds
    from kvserve.workers.builder import build_model
    from kvserve.workers.model_executor.tiny import tiny_checkpoint

    model = build_model(tiny_checkpoint(), torch.device("cpu"), torch.float32, None)
    assert model.lm_head.weight.is_mkldnn
    with pytest.raises(NotImplementedError):
        model.lm_head.weight.sum()
    expected = sum(p.numel() * 4 for name, p in model.named_parameters() if "embed" not in name)
    assert weight_bytes_per_decode_step(model) == expected
    assert weights_read_seconds(model, repeats=2) > 0
