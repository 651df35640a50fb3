"""`kvserve bench machine` (kvserve/bench/machine.py): the machine's rates that benchmark numbers
and CI times are quoted with; `.ci/run` prints it around the suite."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import torch

from kvserve.bench import machine
from kvserve.workers.model_executor.cpu_kernels import cpu_summary, native_bf16
from tests.test_cli import run_json


def test_the_stolen_share_is_the_steal_ticks_over_all_ticks_between_readings():
    assert machine.stolen_pct((1000, 10), (1400, 110)) == pytest.approx(25.0)
    assert machine.stolen_pct((1000, 10), (1000, 10)) == 0.0  # no time passed: not a division
    total, steal = machine.cpu_ticks()
    later = machine.cpu_ticks()
    assert 0 <= steal <= total <= later[0]


def test_a_gemm_rate_is_its_flops_over_its_best_call(monkeypatch):
    calls = []

    def half_a_second(fn, budget_s):
        calls.append(fn().shape)  # the matmul it would time
        return 0.5

    monkeypatch.setattr(machine, "seconds_per_call", half_a_second)
    # 2 n^3 flops (a multiply and an add per term) in 0.5 s
    assert machine.gemm_gflop_s(torch.float32, n=100) == pytest.approx(2 * 100**3 / 0.5 / 1e9)
    assert calls == [(100, 100)]


def test_a_slow_gemm_is_timed_at_a_size_that_fits_the_budget():
    """A dtype torch multiplies slowly (bf16 without native support: ~1 GFLOP/s, a 256^3 probe
    in ~40 ms) is timed at a smaller n, so the gauge takes seconds, not ~12 s; a fast one
    (a probe in 0.1 ms) keeps GEMM_N."""
    assert machine.fitting_n(1024, probe_s=0.04, call_s=0.125) == 256
    assert machine.fitting_n(1024, probe_s=0.002, call_s=0.125) == 512  # 1024: 0.128 s
    assert machine.fitting_n(1024, probe_s=1e-4, call_s=0.125) == 1024
    assert machine.fitting_n(machine.PROBE_N, probe_s=10.0, call_s=0.0) == machine.PROBE_N


def test_bench_machine_json_names_the_cpu_and_measures_every_rate():
    report = run_json("bench", "machine", "--json")
    assert report["cpu"] == cpu_summary()
    assert report["threads"] >= 1
    # a 2-core VM reads 10-60 GB/s and multiplies 50-2,000 GFLOP/s; zero or absurd values mean
    # a unit slip (bytes vs GB, a missing factor 2) or a timing of nothing
    assert 1 < report["memory_read_gb_s"] < 2000
    assert 5 < report["fp32_gemm_gflop_s"] < 100_000
    # without AVX512-BF16 or AMX-BF16, torch multiplies bf16 in a scalar fallback: ~1 GFLOP/s
    # on an AVX2-only AMD EPYC
    assert (5 if native_bf16() else 0.05) < report["bf16_gemm_gflop_s"] < 100_000
    assert 1 < report["python_loop_ns"] < 10_000  # CPython: tens of ns an iteration
    assert 0 <= report["stolen_pct"] <= 100


def test_ci_prints_the_gauge_before_and_after_the_suite():
    ci = Path(__file__).parents[1] / ".ci" / "run"
    script = subprocess.run(["bash", "-n", str(ci)], capture_output=True, text=True)
    assert script.returncode == 0, script.stderr
    lines = ci.read_text().splitlines()
    gauges = [i for i, line in enumerate(lines) if line.endswith("kvserve bench machine")]
    suite = lines.index("make test || rc=$?")
    assert len(gauges) == 2 and gauges[0] < suite < gauges[1]
