"""GFLOP/s of the CPU projection paths on SmolLM2-135M's shapes, to choose between them.

    python -m kvserve.bench.linear [--rows 1 8 32 128 512] [--seconds 0.3] [--threads 1]
    python -m kvserve.bench.linear --step [--rows ...] [--isa avx2]

`--step`: every projection of one step over the default model's own weights, as a decode step
runs them (each weight once, 538 MB of fp32 panels: no cache holds them), fp32 panels (`linear`)
against the GGUF's block codes (`linear_codes`, 115 MB), with the outputs checked equal bit for
bit. `--isa avx2` runs kvserve's fp32 kernels on AVX2 + FMA where the CPU also has AVX-512
(the path an AVX2-only CPU takes; the same bits).

Per shape (in -> out) and row count: kvserve's bf16 kernel (`linear_bf16`), oneDNN prepacked bf16
(what `Linear.pack_for_onednn` runs), F.linear bf16 and kvserve's fp32 kernel (`linear`), with the
CPU's model and flags first: the answer depends on them (AMX, AVX512-BF16's vdpbf16ps rate). At
one row a projection is a read of its weights, so that row also gives the weight bytes per second.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from kvserve.workers.model_executor.cpu_kernels import (
    CpuKernels,
    cpu_features,
    linear_available_for,
    load_cpu_kernels,
)
from kvserve.workers.model_executor.model import PACK_ROWS

# SmolLM2-135M: hidden 576, 9 query and 3 KV heads of 64, intermediate 1536, vocab 49152
SHAPES = {"qkv": (576, 960), "o": (576, 576), "gate_up": (576, 3072), "down": (1536, 576),
          "lm_head": (576, 49152)}
ROWS = [1, 8, 32, 128, 512]


def seconds_per_call(fn: Callable[[], torch.Tensor], budget_s: float) -> float:
    """Fastest call of `fn` over calls filling about `budget_s` (after one warm-up call): on
    shared cores a median measures the neighbours, a minimum what the code can do."""
    fn()
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < 3 or time.perf_counter() - start < budget_s:
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def paths(kernels: CpuKernels | None, w: torch.Tensor,
          x: torch.Tensor) -> dict[str, Callable[[], torch.Tensor]]:
    """The projections to time, each x [rows, in] -> [rows, out], on the same weight w [out, in]."""
    wb, xb = w.to(torch.bfloat16), x.to(torch.bfloat16)
    onednn = torch.ops.mkldnn._reorder_linear_weight(wb, PACK_ROWS)
    out: dict[str, Callable[[], torch.Tensor]] = {}
    n = w.shape[0]
    if kernels is not None and linear_available_for(kernels, torch.bfloat16):
        packed = kernels.pack_linear_weight_bf16(wb)
        out["kvserve bf16"] = lambda: kernels.linear_bf16(xb, packed, n, None)
    out["oneDNN bf16"] = lambda: torch.ops.mkldnn._linear_pointwise(xb, onednn, None, "none",
                                                                    [], "")
    out["F.linear bf16"] = lambda: F.linear(xb, wb)
    if kernels is not None and linear_available_for(kernels, torch.float32):
        packed32 = kernels.pack_linear_weight(w)
        out["kvserve fp32"] = lambda: kernels.linear(x, packed32, n, None)
    return out


def step_weights_bench(kernels: CpuKernels, rows: list[int], seconds: float,
                       tensors: dict[str, torch.Tensor] | None = None) -> dict[int, float]:
    """`--step`: ms for one step's projections at each row count, fp32 panels against block
    codes, over the default model's weights (the tied lm_head included), or `tensors`' matrices.
    Returns {rows: fp32 panels' time / block codes' time}."""
    if tensors is None:
        from kvserve.workers.model_executor.loader import load_checkpoint

        tensors = load_checkpoint(None).tensors
    weights = [t.float().contiguous() for t in tensors.values() if t.dim() == 2]
    packs = {"fp32 panels": [(kernels.pack_linear_weight(w), w.shape[0], w.shape[1])
                             for w in weights]}
    codes = [(kernels.pack_linear_weight_codes(w), w.shape[0], w.shape[1]) for w in weights]
    if all(c is not None for c, _, _ in codes):
        packs["block codes"] = codes
    for label, pack in packs.items():
        print(f"{label}: {sum(p.numel() * p.element_size() for p, _, _ in pack) / 1e6:.0f} MB")
    kernel = {"fp32 panels": kernels.linear, "block codes": kernels.linear_codes}
    print(f"  {'rows':>5} " + " ".join(f"{h + ' ms':>15}" for h in packs) + "    ratio")
    gen = torch.Generator().manual_seed(0)
    ratios = {}
    for n_rows in rows:
        xs = {k: torch.randn(n_rows, k, generator=gen) for _, _, k in codes}

        def run(label: str, xs: dict[int, torch.Tensor] = xs) -> list[torch.Tensor]:
            return [kernel[label](xs[k], p, n, None) for p, n, k in packs[label]]

        if "block codes" in packs:
            same = all(torch.equal(a.view(torch.int32), b.view(torch.int32))
                       for a, b in zip(run("fp32 panels"), run("block codes"), strict=True))
            assert same, "block codes and fp32 panels differ"
        ms = {label: seconds_per_call(lambda label=label: run(label), seconds) * 1e3
              for label in packs}
        ratios[n_rows] = ratio = (ms["fp32 panels"] / ms["block codes"] if "block codes" in ms
                                  else float("nan"))
        print(f"  {n_rows:5d} " + " ".join(f"{v:15.1f}" for v in ms.values())
              + f"    {ratio:.2f}x")
    return ratios


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=ROWS)
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--seconds", type=float, default=0.3, help="timing budget per cell")
    parser.add_argument("--threads", type=int, default=0, help="intra-op threads (0: torch's)")
    parser.add_argument("--isa", choices=["avx512", "avx2"], default=None,
                        help="the instruction set of kvserve's fp32 kernels (default: the "
                             "best this CPU has)")
    parser.add_argument("--step", action="store_true",
                        help="one step's projections over the default model's own weights: "
                             "fp32 panels against the GGUF's block codes")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(cpu_features())
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads\n")
    kernels = load_cpu_kernels()
    if args.isa and kernels is not None:
        kernels.set_linear_isa(args.isa)
    if kernels is not None and linear_available_for(kernels, torch.float32):
        print(f"kvserve's fp32 kernels on {kernels.linear_isa()}\n")
    if args.step:
        if not linear_available_for(kernels, torch.float32):
            raise SystemExit("--step needs kvserve's fp32 kernels (an AVX2 or AVX-512 build)")
        with torch.inference_mode():
            step_weights_bench(kernels, args.rows, args.seconds)
        return
    gen = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        for name in args.shapes:
            k, n = SHAPES[name]
            w = torch.randn(n, k, generator=gen) / k**0.5
            print(f"{name} {k}->{n}: GFLOP/s (at 1 row: GB/s of bf16 / fp32 weights)")
            header = None
            for rows in args.rows:
                x = torch.randn(rows, k, generator=gen)
                cells = {label: seconds_per_call(fn, args.seconds)
                         for label, fn in paths(kernels, w, x).items()}
                if header is None:
                    header = list(cells)
                    print(f"  {'rows':>5} " + " ".join(f"{h:>15}" for h in header))
                flop = 2 * rows * k * n
                line = " ".join(f"{flop / s / 1e9:15.1f}" for s in cells.values())
                print(f"  {rows:5d} {line}")
                if rows == 1:
                    gbs = [n * k * (4 if "fp32" in h else 2) / s / 1e9 for h, s in cells.items()]
                    print("  GB/s  " + " ".join(f"{g:15.1f}" for g in gbs))
            print()


if __name__ == "__main__":
    main()
