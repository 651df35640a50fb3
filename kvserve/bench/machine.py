"""`kvserve bench machine`: how fast this machine is right now, in the units the other
benchmarks divide by.

Why: the shared VMs this project runs on change speed from one day to the next (CI of nearly
the same code took 9 min 46 s to 11 min 11 s one day and 14 min 23 s to 16 min 21 s the next,
about every test 1.5x slower; the greedy suite, pure compute, took 139 s alone on an idle
machine the second day against 94-101 s inside full runs the first). A number from `kvserve
bench throughput` or a CI time means little without the machine's own rates beside it: memory
read bandwidth (what batch-1 decode is bound by), fp32 and bf16 GEMM rates (what prefill and
large batches are bound by), a bare Python loop's speed (what the interpreter-bound rest is bound
by) and the CPU time the hypervisor stole while they ran. `.ci/run` prints it before and after
the suite.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from kvserve.bench.baselines import measure_memory_bandwidth
from kvserve.bench.linear import seconds_per_call
from kvserve.workers.model_executor.cpu_kernels import cpu_summary

GEMM_N = 1024  # square: 2.1 GFLOP a call, large enough for every core, small enough to repeat


@dataclass(frozen=True)
class MachineGauge:
    cpu: str  # model and the flags that decide matmul rates
    threads: int  # torch intra-op threads the rates were measured with
    memory_read_gb_s: float  # best sum() over a fresh 512 MiB fp32 buffer
    fp32_gemm_gflop_s: float  # best [N, N] @ [N, N], N = GEMM_N
    bf16_gemm_gflop_s: float  # the same, N smaller where bf16 is a slow fallback
    python_loop_ns: float  # best ns per iteration of `for i in range(n): s += i`
    stolen_pct: float  # of the CPU time while the gauge ran, taken by the hypervisor

    def summary(self) -> str:
        return (f"machine: {self.cpu}, {self.threads} threads: memory read "
                f"{self.memory_read_gb_s:.1f} GB/s, GEMM fp32 {self.fp32_gemm_gflop_s:.0f} / "
                f"bf16 {self.bf16_gemm_gflop_s:.0f} GFLOP/s, Python loop "
                f"{self.python_loop_ns:.0f} ns/iter, {self.stolen_pct:.1f} % stolen")

    def to_dict(self) -> dict:
        return asdict(self)


def gemm_gflop_s(dtype: torch.dtype, n: int = GEMM_N, budget_s: float = 0.5) -> float:
    """The best rate of an [n, n] @ [n, n] matmul in `dtype` over about `budget_s`. Where one
    call would take more than a quarter of the budget (bf16 on a CPU without AVX512-BF16 or
    AMX runs a scalar fallback at ~1 GFLOP/s: 3 s a call at n = 1024), n is halved until it
    does not, by a timed call at PROBE_N, so the gauge stays within seconds."""
    if n > PROBE_N:
        probe = torch.randn(PROBE_N, PROBE_N).to(dtype)
        # the fastest of three calls after a warm-up: one descheduled call does not shrink n
        n = fitting_n(n, seconds_per_call(lambda: probe @ probe, budget_s=0), budget_s / 4)
    a = torch.randn(n, n).to(dtype)
    b = torch.randn(n, n).to(dtype)
    return 2 * n**3 / seconds_per_call(lambda: a @ b, budget_s) / 1e9


PROBE_N = 256


def fitting_n(n: int, probe_s: float, call_s: float) -> int:
    """The largest of n, n/2, ... (not below PROBE_N) whose matmul takes at most `call_s`, as a
    call at PROBE_N that took `probe_s` predicts (a cube law)."""
    while n > PROBE_N and probe_s * (n / PROBE_N) ** 3 > call_s:
        n //= 2
    return n


def python_loop_ns(iterations: int = 200_000, budget_s: float = 0.1) -> float:
    """Best nanoseconds per iteration of a bare interpreter loop: the speed of what is bound by
    Python rather than by matmuls (scheduling, Ray, gRPC, transformers' small-batch decode, most
    of the test suite), which can differ from one day to the next while the GEMM rates do not."""

    def loop() -> int:
        total = 0
        for i in range(iterations):
            total += i
        return total

    return seconds_per_call(loop, budget_s) / iterations * 1e9


def cpu_ticks() -> tuple[int, int]:
    """(all, stolen) CPU clock ticks since boot, from /proc/stat; (0, 0) where there is none."""
    try:
        fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
    except OSError:
        return 0, 0
    ticks = [int(f) for f in fields[:8]]  # user nice system idle iowait irq softirq steal
    return sum(ticks), ticks[7] if len(ticks) > 7 else 0


def stolen_pct(before: tuple[int, int], after: tuple[int, int]) -> float:
    """Stolen share of the CPU ticks between two `cpu_ticks()` readings, in percent."""
    total = after[0] - before[0]
    return 100.0 * (after[1] - before[1]) / total if total > 0 else 0.0


def measure_machine(budget_s: float = 0.5) -> MachineGauge:
    """Measure this machine's rates now (about 3 s with the default budget)."""
    before = cpu_ticks()
    memory = measure_memory_bandwidth()
    fp32 = gemm_gflop_s(torch.float32, budget_s=budget_s)
    bf16 = gemm_gflop_s(torch.bfloat16, budget_s=budget_s)
    return MachineGauge(cpu_summary(), torch.get_num_threads(), memory / 1e9, fp32, bf16,
                        python_loop_ns(), stolen_pct(before, cpu_ticks()))
