"""`kvserve bench gpu-compile`: every Triton kernel configuration kvserve can launch, compiled for
Ampere (sm_80), Hopper (sm_90) and Blackwell (sm_100) on a machine with no GPU, each checked
against what fails first on a real card.

Why: the kernels are tested on CPUs under Triton's interpreter, which cannot see a tile shape
whose shared memory exceeds the SM's per-block limit (Triton raises `OutOfResources` only when a
GPU loads the kernel), register spills (a kernel 3x slower), or a `tl.dot` that did not lower to
tensor-core instructions. A compile for the real target shows all three, and needs no device.

What is compiled is what the engine launches, not a list copied from it: for each model shape
(per tensor-parallel rank), dtype and KV block size, kvserve's own wrappers (`paged_attention`,
`rms_norm`, `silu_and_mul`, `rotary_write_kv_`) are called on small CPU tensors of the engine's
layouts while launches are recorded (`triton_compat.recording_launches`); their tile shapes,
num_warps and num_stages come from the selection logic in the kernels' modules. Each distinct
launch (kernel, constexprs, options, argument specialization) is compiled once per GPU.

A configuration fails when its shared memory (dynamic + static) exceeds the GPU's per-block
opt-in limit, when it spills registers, or when it calls `tl.dot` for a 16-bit model and its
PTX has no tensor-core instruction (`mma.sync`; `wgmma` on sm_90; `tcgen05.mma` on sm_100).
fp32 models' attention dots run in fp32 FMA on purpose (IEEE precision, the exactness
reference), so they are reported, not failed. The command exits 1 on any failure.
"""

from __future__ import annotations

import json
import math
import os
import platform
import re
import sys
import time
from collections import defaultdict
from collections.abc import Iterable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from multiprocessing import get_context
from typing import Any

from kvserve.bench import triton_compat
from kvserve.bench.gpu_check import LLAMA_1B_SHAPE, SMOLLM2_SHAPE
from kvserve.columns import aligned


@dataclass(frozen=True)
class GPU:
    """A compile target and the per-SM resources its checks use (CUDA's device attributes)."""

    name: str
    capability: int
    examples: str
    shared_per_block: int  # bytes: cudaDevAttrMaxSharedMemoryPerBlockOptin
    shared_per_sm: int
    max_threads_per_sm: int
    max_blocks_per_sm: int
    tensor_core_ops: tuple[str, ...]  # PTX instructions that run on the tensor cores
    registers_per_sm: int = 65536


GPUS = {
    "sm_80": GPU("sm_80", 80, "A100", 163 * 1024, 164 * 1024, 2048, 32, ("mma.sync",)),
    "sm_86": GPU("sm_86", 86, "A10, A40, RTX 30xx", 99 * 1024, 100 * 1024, 1536, 16,
                 ("mma.sync",)),
    "sm_89": GPU("sm_89", 89, "L4, L40S, RTX 40xx", 99 * 1024, 100 * 1024, 1536, 24,
                 ("mma.sync",)),
    "sm_90": GPU("sm_90", 90, "H100, H200", 227 * 1024, 228 * 1024, 2048, 32,
                 ("wgmma.mma_async", "mma.sync")),
    "sm_100": GPU("sm_100", 100, "B200", 227 * 1024, 228 * 1024, 2048, 32,
                  ("tcgen05.mma", "wgmma.mma_async", "mma.sync")),
}
DEFAULT_GPUS = ("sm_80", "sm_90", "sm_100")


@dataclass(frozen=True)
class ModelShape:
    """The widths kvserve's kernels see from a model, and the tensor-parallel sizes it runs at
    (each rank's kernels get heads / tp, kv_heads / tp and intermediate / tp)."""

    heads: int
    kv_heads: int
    head_dim: int
    hidden: int
    intermediate: int
    tp_sizes: tuple[int, ...] = (1,)
    softcap: float = 0.0  # Gemma 2's attention soft-cap: its own compile of the attention
    window: int = 0  # a sliding window (a runtime argument: the same compile as without)

    @classmethod
    def of(cls, config: dict[str, Any], tp_sizes: tuple[int, ...]) -> ModelShape:
        return cls(config["num_attention_heads"], config["num_key_value_heads"],
                   config["head_dim"], config["hidden_size"], config["intermediate_size"],
                   tp_sizes)


# The families kvserve serves (docs/models.md), at the sizes people run: head dims 64, 96
# (Phi-3, padded to 128 in the tiles) and 128, GQA groups 1 (multi-head) to 8, every tp that
# divides the heads up to 8. Qwen3's shapes are Llama's (its q/k norms are torch ops);
# Mixtral's attention is Mistral's (its experts are torch matmuls). Gemma: head dim 256, and
# Gemma 2's soft-capped attention.
SHAPES = {
    "smollm2-135m": ModelShape.of(SMOLLM2_SHAPE, (1, 3)),
    "llama-3.2-1b": ModelShape.of(LLAMA_1B_SHAPE, (1, 2, 4, 8)),
    "qwen2.5-0.5b": ModelShape(14, 2, 64, 896, 4864, (1, 2)),
    "llama-3.1-8b": ModelShape(32, 8, 128, 4096, 14336, (1, 2, 4, 8)),
    "mistral-7b": ModelShape(32, 8, 128, 4096, 14336, (1, 2, 4, 8)),
    "qwen2.5-7b": ModelShape(28, 4, 128, 3584, 18944, (1, 2, 4)),
    "llama-3.1-70b": ModelShape(64, 8, 128, 8192, 28672, (1, 2, 4, 8)),
    "llama-2-7b": ModelShape(32, 32, 128, 4096, 11008, (1, 2, 4, 8)),
    "phi-3-mini": ModelShape(32, 32, 96, 3072, 8192, (1, 2, 4, 8)),
    "gemma-2-2b": ModelShape(8, 4, 256, 2304, 9216, (1, 2, 4), softcap=50.0, window=4096),
    "gemma-2-9b": ModelShape(16, 8, 256, 3584, 14336, (1, 2, 4, 8), softcap=50.0,
                             window=4096),
    "gemma-3-1b": ModelShape(4, 1, 256, 1152, 6912, (1,), window=512),
}
DTYPES = ("bfloat16", "float16", "float32")
# 16: the default; 32; 256: flash_attn's layout, which a cache shared with it has
BLOCK_SIZES = (16, 32, 256)
# what `make test` compiles (tests/test_gpu_compile.py): the engine's picks for the two shapes
# `make gpu-check` runs, on the device it runs on
CI_SHAPES = ("smollm2-135m", "llama-3.2-1b")


@dataclass
class Config:
    """One distinct launch, and every (shape, tp, dtype, block size) that makes it."""

    launch: triton_compat.Launch
    kernel: str
    dtype: str
    head_dim: int
    dot_fp32: bool
    used_by: list[str] = field(default_factory=list)


KERNELS = ("attention decode", "attention merge", "attention prefill", "rotary + kv write",
           "rms_norm", "rms_norm + residual", "silu_and_mul")


def _launches(shape: ModelShape, tp: int, dtype_name: str, block_size: int,
              dot_fp32: bool) -> list[tuple[str, triton_compat.Launch]]:
    """The launches one decoder layer of `shape` makes at rank size `tp` on the triton backend:
    (what, launch). The tensors are tiny, laid out as the engine lays them out."""
    import torch

    from kvserve.workers.model_executor import triton_ops
    from kvserve.workers.model_executor.attention import triton_kernels

    dtype = getattr(torch, dtype_name)
    heads, kv_heads, d = shape.heads // tp, shape.kv_heads // tp, shape.head_dim
    inter = shape.intermediate // tp
    decodes, prefill = 2, 8
    tokens = decodes + prefill
    # q is a view of the fused q/k/v projection's output, as in Attention.forward
    qkv = torch.zeros(tokens, heads + 2 * kv_heads, d, dtype=dtype)
    q = qkv[:, :heads]
    cache = torch.zeros(4, block_size, kv_heads, d, dtype=dtype)
    tables = torch.zeros(decodes + 1, 2, dtype=torch.int32)
    seq_lens = torch.tensor([5, 9, prefill], dtype=torch.int32)
    starts = torch.tensor([0, 1, 2, tokens], dtype=torch.int32)
    cos = torch.zeros(tokens, d, dtype=dtype)
    slots = torch.zeros(tokens, dtype=torch.int64)
    x = torch.zeros(tokens, shape.hidden, dtype=dtype)
    weight = torch.zeros(shape.hidden, dtype=dtype)
    gate_up = torch.zeros(tokens, 2 * inter, dtype=dtype)
    made: list[tuple[str, triton_compat.Launch]] = []
    with triton_compat.recording_launches() as launches:
        triton_kernels.paged_attention(q, cache, cache, tables, seq_lens, starts,
                                       num_decodes=decodes, scale=d ** -0.5,
                                       dot_fp32=dot_fp32, max_decode_context=9,
                                       window=shape.window, softcap=shape.softcap)
        made += zip(KERNELS[:3], launches, strict=True)
        launches.clear()
        triton_ops.rotary_write_kv_(qkv, heads, kv_heads, cos, cos, cache, cache, slots)
        triton_ops.rms_norm(x, weight, 1e-5)
        triton_ops.rms_norm(x, weight, 1e-5, residual=x)
        triton_ops.silu_and_mul(gate_up)
        made += zip(KERNELS[3:], launches, strict=True)
    return made


def _arg_key(arg: Any) -> Any:
    """What of an argument a launch specializes on: a tensor's dtype and 16-byte alignment, an
    int's being 1 or a multiple of 16."""
    if hasattr(arg, "data_ptr"):
        return (str(arg.dtype), arg.data_ptr() % 16 == 0)
    if isinstance(arg, bool) or not isinstance(arg, int):
        return type(arg).__name__
    return ("int", arg == 1, arg % 16 == 0)


def enumerate_configs(shapes: Iterable[str], dtypes: Iterable[str], block_sizes: Iterable[int],
                      dot_fp32: bool = False, tp_sizes: Iterable[int] | None = None,
                      kernels: Iterable[str] | None = None) -> list[Config]:
    """Every distinct launch the engine can make for these shapes, dtypes and block sizes (at
    each shape's tensor-parallel sizes, or those of `tp_sizes` it runs at; of `kernels`, or
    all of KERNELS)."""
    configs: dict[Any, Config] = {}
    for shape_name in shapes:
        shape = SHAPES[shape_name]
        for tp in shape.tp_sizes:
            if tp_sizes is not None and tp not in tp_sizes:
                continue
            for dtype in dtypes:
                for block_size in block_sizes:
                    label = f"{shape_name} tp{tp} {dtype} block {block_size}"
                    for what, launch in _launches(shape, tp, dtype, block_size, dot_fp32):
                        if kernels is not None and what not in kernels:
                            continue
                        key = (launch.name, tuple(sorted(launch.kwargs.items())),
                               tuple(_arg_key(a) for a in launch.args))
                        if key not in configs:
                            configs[key] = Config(launch, what, dtype, shape.head_dim,
                                                  dot_fp32 or dtype == "float32")
                        configs[key].used_by.append(label)
    return list(configs.values())


# the tile constexprs a row shows (the rest are widths)
SHOWN = ("HEAD_DIM_P", "BLOCK_SIZE", "BLOCK_M", "BLOCK_Q", "BLOCK_N", "BLOCK", "ROT_BLOCK",
         "HALF_BLOCK", "GROUP", "MAX_S")
_DOT = re.compile(r"tt\.dot .*: tensor<[^>]*x(\w+)(?:, #[^>]*)?> \* tensor<")


def check(config: Config, gpu: GPU) -> dict[str, Any]:
    """Compile `config` for `gpu` and judge it: one row of the report."""
    compiled = triton_compat.compile_launch(config.launch, gpu.capability)
    usage = triton_compat.resource_usage(compiled)
    threads = 32 * compiled.options["num_warps"]
    shared = compiled.shared_dynamic + usage.shared_static
    dot_types = sorted(set(_DOT.findall(compiled.ttir)))
    has_dot = "tt.dot" in compiled.ttir
    tensor_ops = [op for op in gpu.tensor_core_ops if op in compiled.ptx]
    expects_tensor_cores = has_dot and config.dtype != "float32"
    # theoretical residency: blocks per SM by registers (allocated per warp in 256s), by
    # shared memory, by threads; what the GPU achieves needs a device
    regs_per_warp = math.ceil(usage.registers * 32 / 256) * 256
    by_regs = gpu.registers_per_sm // (regs_per_warp * compiled.options["num_warps"])
    by_shared = gpu.shared_per_sm // shared if shared else gpu.max_blocks_per_sm
    blocks_per_sm = min(by_regs, by_shared, gpu.max_threads_per_sm // threads,
                        gpu.max_blocks_per_sm)
    problems = []
    if shared > gpu.shared_per_block:
        problems.append(f"shared memory {shared} B over the {gpu.shared_per_block} B limit")
    if usage.spill_stores or usage.spill_loads:
        problems.append(f"spills {usage.spill_stores} B stored, {usage.spill_loads} B loaded")
    if expects_tensor_cores and not tensor_ops:
        problems.append(f"tl.dot ({'/'.join(dot_types) or '?'} operands) without "
                        f"tensor-core instructions")
    if blocks_per_sm < 1:
        problems.append("not one block fits an SM")
    shown = {k: v for k, v in compiled.constexprs.items() if k in SHOWN}
    return {
        "gpu": gpu.name, "kernel": config.kernel, "function": compiled.name,
        "dtype": config.dtype, "head_dim": config.head_dim, **shown, **compiled.options,
        "shared_dynamic": compiled.shared_dynamic, "shared_static": usage.shared_static,
        "shared_bytes": shared, "shared_limit": gpu.shared_per_block,
        "registers": usage.registers, "spill_stores": usage.spill_stores,
        "spill_loads": usage.spill_loads, "local_bytes": usage.local_bytes,
        "blocks_per_sm": blocks_per_sm, "dot_operands": dot_types,
        "tensor_core_ops": tensor_ops, "expects_tensor_cores": expects_tensor_cores,
        "compile_s": round(compiled.compile_s, 3), "used_by": len(config.used_by),
        "example": config.used_by[0], "ok": not problems, "problems": problems,
    }


_JOBS: list[tuple[Config, GPU]] = []


def _run_job(index: int) -> dict[str, Any]:
    config, gpu = _JOBS[index]
    try:
        return check(config, gpu)
    except Exception as e:  # a compile error is a failed configuration, not a crash
        return {"gpu": gpu.name, "kernel": config.kernel, "function": config.launch.name,
                "dtype": config.dtype, "head_dim": config.head_dim, "ok": False,
                "example": config.used_by[0], "used_by": len(config.used_by),
                "problems": [f"compile failed: {type(e).__name__}: {str(e)[:500]}"]}


def run_sweep(configs: Sequence[Config], gpus: Sequence[GPU], jobs: int,
              progress: bool = True) -> list[dict[str, Any]]:
    """Compile every configuration for every GPU, `jobs` at a time (forked processes)."""
    from tqdm import tqdm

    _JOBS[:] = [(c, g) for g in gpus for c in configs]
    indices = range(len(_JOBS))
    bar = tqdm(total=len(_JOBS), desc="compiling", unit="kernel", disable=not progress,
               file=sys.stderr)
    rows: list[dict[str, Any]] = []
    try:
        if jobs <= 1:
            for i in indices:
                rows.append(_run_job(i))
                bar.update()
        else:
            with ProcessPoolExecutor(jobs, mp_context=get_context("fork")) as pool:
                for row in pool.map(_run_job, indices, chunksize=4):
                    rows.append(row)
                    bar.update()
    finally:
        bar.close()
        _JOBS.clear()
    return rows


def versions(gpus: Sequence[GPU]) -> dict[str, Any]:
    import torch
    import triton

    from kvserve.workers.model_executor.cpu_kernels import cpu_summary

    return {"triton": triton.__version__, "torch": torch.__version__,
            "python": platform.python_version(), "cpu": cpu_summary(),
            "ptxas": {g.name: triton_compat.ptxas_version(g.capability) for g in gpus}}


def summarize(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per GPU and kernel: how many configurations, the worst of each resource, failures."""
    groups: dict[tuple[str, str, str], list[dict[str, Any]]] = defaultdict(list)
    for row in rows:
        groups[(row["gpu"], row["kernel"], row["dtype"])].append(row)
    out = []
    for (gpu, kernel, dtype), members in groups.items():
        compiled = [r for r in members if "registers" in r]
        out.append({
            "gpu": gpu, "kernel": kernel, "dtype": dtype, "configs": len(members),
            "max_shared": max((r["shared_bytes"] for r in compiled), default=0),
            "shared_limit": GPUS[gpu].shared_per_block,
            "max_registers": max((r["registers"] for r in compiled), default=0),
            "spill_bytes": sum(r["spill_stores"] + r["spill_loads"] for r in compiled),
            "min_blocks_per_sm": min((r["blocks_per_sm"] for r in compiled), default=0),
            "tensor_cores": _tensor_core_summary(compiled),
            "max_compile_s": max((r["compile_s"] for r in compiled), default=0.0),
            "failed": sum(not r["ok"] for r in members),
        })
    return out


def _tensor_core_summary(rows: Sequence[dict[str, Any]]) -> str:
    if not any(r["dot_operands"] for r in rows):
        return "no tl.dot"
    ops = sorted({op for r in rows for op in r["tensor_core_ops"]})
    if not ops:
        return "none (fp32 FMA)" if not any(r["expects_tensor_cores"] for r in rows) else "NONE"
    missing = sum(r["expects_tensor_cores"] and not r["tensor_core_ops"] for r in rows)
    return ", ".join(ops) + (f" ({missing} without)" if missing else "")


def table(summary: Sequence[dict[str, Any]]) -> str:
    head = ("GPU", "KERNEL", "DTYPE", "CONFIGS", "MAX SHARED / LIMIT", "MAX REGS", "SPILLS",
            "MIN BLOCKS/SM", "TENSOR CORES", "MAX COMPILE", "FAILED")
    lines = [head]
    for s in summary:
        lines.append((s["gpu"], s["kernel"], s["dtype"], str(s["configs"]),
                      f"{s['max_shared'] / 1024:.1f} / {s['shared_limit'] // 1024} KiB",
                      str(s["max_registers"]), f"{s['spill_bytes']} B",
                      str(s["min_blocks_per_sm"]), s["tensor_cores"],
                      f"{s['max_compile_s']:.2f} s", str(s["failed"])))
    return "\n".join(aligned(lines))


def report(rows: list[dict[str, Any]], gpus: Sequence[GPU], settings: dict[str, Any],
           seconds: float) -> dict[str, Any]:
    return {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "command": "kvserve " + " ".join(sys.argv[1:]),
        "versions": versions(gpus), "settings": settings,
        "gpus": {g.name: asdict(g) for g in gpus}, "seconds": round(seconds, 1),
        "configs": len(rows), "failed": sum(not r["ok"] for r in rows),
        "summary": summarize(rows), "rows": rows,
    }


def main(shapes: Sequence[str], dtypes: Sequence[str], block_sizes: Sequence[int],
         gpus: Sequence[str], jobs: int, out: str | os.PathLike | None, as_json: bool,
         dot_fp32: bool,
         show_all: bool, tp_sizes: Sequence[int] | None = None,
         kernels: Sequence[str] | None = None) -> int:
    """The command: compile, print the table (or JSON), write JSON to `out`; 1 on a failure."""
    start = time.perf_counter()
    targets = [GPUS[g] for g in gpus]
    configs = enumerate_configs(shapes, dtypes, block_sizes, dot_fp32=dot_fp32,
                                tp_sizes=tp_sizes, kernels=kernels)
    if not configs:
        print("no configuration: no shape runs at those --tp sizes", file=sys.stderr)
        return 2
    rows = run_sweep(configs, targets, jobs, progress=not as_json)
    settings = {"shapes": {s: asdict(SHAPES[s]) for s in shapes}, "dtypes": list(dtypes),
                "block_sizes": list(block_sizes), "tp_sizes": tp_sizes, "kernels": kernels,
                "dot_fp32_forced": dot_fp32}
    result = report(rows, targets, settings, time.perf_counter() - start)
    if out:
        os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
        with open(out, "w") as f:  # a row per line: ~0.5 KB each, thousands of them
            rows_json = ",\n".join(json.dumps(r, separators=(",", ":")) for r in rows)
            head = json.dumps({**result, "rows": []}, indent=1)
            f.write(head[:head.rindex("[]")] + "[\n" + rows_json + "\n]\n}\n")
    if as_json:
        print(json.dumps(result))
    else:
        v = result["versions"]
        print(f"triton {v['triton']}, ptxas " + ", ".join(
            f"{g} {p}" for g, p in v["ptxas"].items()) + f"; {len(configs)} launches x "
            f"{len(targets)} GPUs in {result['seconds']} s on {v['cpu']}")
        print(table(result["summary"]))
        bad = [r for r in rows if not r["ok"] or show_all]
        for r in bad:
            print(f"{'FAIL' if not r['ok'] else 'ok  '} {r['gpu']} {r['kernel']} {r['dtype']} "
                  f"({r['example']}, {r['used_by']} uses): "
                  + ("; ".join(r["problems"]) or f"{r.get('shared_bytes')} B shared, "
                                                   f"{r.get('registers')} registers"))
        if out:
            print(f"wrote {out}")
    return 1 if result["failed"] else 0
