"""kvserve's C++ kernels for CPUs (`kvserve/workers/model_executor/csrc/`), built by `kvserve
prepare`
(or else at the first engine start on the machine).

- `linear` (`pack_linear_weight`): every projection, batch-invariant, weights in 48-output
  panels, on AVX-512 or AVX2 + FMA, chosen at run time with the same bits on either
  (`linear_isa()` says which; `set_linear_isa` or KVSERVE_CPU_ISA forces one, `none` included;
  with neither oneDNN runs them, and the engine says so at its start).
- `linear_codes` (`pack_linear_weight_codes`): `linear`'s output bit for bit from a GGUF
  checkpoint's block codes (Q4_1: 0.75 bytes a weight, Q8_0: 1.125) instead of fp32 panels, kept
  only where every weight decodes back exactly; batch-1 decode reads a fifth of the bytes.
- `linear_bf16` (`pack_linear_weight_bf16`): the same for bf16 weights and activations, fp32
  multiply-adds, bf16 out (`bf16_linear_available()`; `linear_available_for` asks per dtype),
  on the same two instruction sets: AVX2 has no bf16 instruction, and needs none.
- `decode_layer`: a whole decoder layer of a decode-only step in one call, over the kernels here.
- `paged_decode`: decode attention read in place through the block table (the `cpu` attention
  backend, `kvserve/workers/model_executor/attention/cpu_backend.py`), fp32 or bf16 (computed in
  fp32).
- `rms_norm`, `silu_and_mul`, `rotary_`: the decoder layer's elementwise work, one pass each
  instead of 2-6 torch ops. In a decode step of 32 sequences those small ops, each on a few
  thousand floats with cold caches after a matmul, cost ~25 % of the step on this CPU. In bf16
  (AVX-512 or AVX2) they round where transformers' bf16 ops round, and equal them bit for bit.
- `apply_token_bitmask_`: structured outputs' grammar mask on fp32 logits, one vectorized pass
  per row (`kvserve/workers/structured_output.py`; any x86-64 or Arm build).

They are compiled with the machine's C++ compiler by `torch.utils.cpp_extension` (~20 s on two
cores, once per torch version and CPU type, cached under kvserve's cache directory:
`kernels_root`) and registered as torch operators (`torch.ops.kvserve.*`, `csrc/bindings.cpp`),
not as a pybind11 module, whose headers alone took longer to compile than all the kernels.
Where that fails the engine
runs the torch ops instead, with one warning. fp32 results differ from torch's only in the order of
float sums (vectorized reductions, fused multiply-adds): the greedy exactness suite meets no
near-tie.
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

import torch

from kvserve.workers.config import cache_root

log = logging.getLogger(__name__)

# What `load_cpu_kernels` returns: the `torch.ops.kvserve` namespace, whose attributes are the
# operators below (`kernels.linear(x, packed, n, bias)`). torch gives that namespace no public
# type, so it is named here once.
CpuKernels = Any

CSRC = Path(__file__).with_name("csrc")
SOURCES = [CSRC / name for name in ("bindings.cpp", "paged_decode.cpp", "fused_ops.cpp",
                                    "linear.cpp", "linear_codes.cpp",
                                    "linear_bf16.cpp", "decode_layer.cpp",
                                    "token_bitmask.cpp")]
HEADERS = [CSRC / name for name in ("kernels.h", "bf16.h", "linear_tile.h")]
# -ffast-math: glibc's vector expf (libmvec) is declared only under it; the kernels see only
# finite values, and reassociated sums are what vectorizing them means
CFLAGS = ["-O3", "-fopenmp", "-ffast-math"]
# -march: the CPU the kernels are compiled for, native by default (the build directory belongs
# to this machine: kvserve's cache directory), or another that this one can run, to build and
# test on an AVX-512 machine what an AVX2-only CPU builds (znver2, haswell)
MARCH_ENV = "KVSERVE_KERNELS_MARCH"
# torch's build lock is a file that a killed build leaves behind, and every later load would
# wait on it for ever; a build takes well under a minute, so a lock this old is stale
STALE_LOCK_S = 600
LIBRARY = "kvserve_cpu_kernels"  # torch.utils.cpp_extension's extension name
# the kernels' instruction set, forced (avx512, avx2, none), as ATEN_CPU_CAPABILITY forces
# torch's: to run what an AVX2-only CPU (or one with neither, Arm's) runs, on a bigger one
ISA_ENV = "KVSERVE_CPU_ISA"
ISAS = ("avx512", "avx2", "none")


def kernels_root() -> Path:
    """Where every caller builds and finds the kernels: kvserve's cache directory (one
    subdirectory per torch, Python and CPU, `build_dir_name`)."""
    return cache_root() / "kernels"


def kernels_march() -> str:
    """The -march the kernels are built with (KVSERVE_KERNELS_MARCH, else native)."""
    return os.environ.get(MARCH_ENV) or "native"


def kernel_build_dir(build_root: Path | None = None) -> Path:
    """This machine's build directory under `build_root` (default `kernels_root()`)."""
    march = kernels_march()
    return (build_root or kernels_root()) / build_dir_name(
        torch.__version__, cpu_features() + ("" if march == "native" else f"\nmarch {march}"))


def kernel_library(build_root: Path | None = None) -> Path:
    """The shared library a build leaves in `kernel_build_dir` (its mtime says when it was
    last built)."""
    return kernel_build_dir(build_root) / f"{LIBRARY}.so"


def build_cpu_kernels(build_root: Path | None = None) -> CpuKernels:
    """Build (or reuse) the kernels; raises where they cannot be built (no compiler, no ninja,
    a read-only cache). `kvserve prepare` calls this to say why; the engine calls
    `load_cpu_kernels`, which falls back to torch's ops."""
    from torch.utils.cpp_extension import load

    build_dir = kernel_build_dir(build_root)
    build_dir.mkdir(parents=True, exist_ok=True)
    clear_stale_lock(build_dir, time.time())
    # torch rebuilds when a source or a flag changes, but it does not read headers: the
    # headers' digest goes in as a flag
    header = hashlib.sha256(b"".join(h.read_bytes() for h in HEADERS)).hexdigest()[:16]
    if not hasattr(torch.ops.kvserve, "linear_available"):  # once per process
        load(name=LIBRARY, sources=[str(s) for s in SOURCES],
             build_directory=str(build_dir),
             extra_cflags=[*CFLAGS, f"-march={kernels_march()}",
                           f"-DKVSERVE_KERNELS_H={header}"],
             extra_ldflags=["-fopenmp"], is_python_module=False, verbose=False)
    kernels = torch.ops.kvserve
    force_isa(kernels, os.environ.get(ISA_ENV, ""))
    return kernels


def force_isa(kernels: CpuKernels, isa: str) -> None:
    """Run the kernels on `isa` (one of ISAS; "" for the best this CPU has). A name not in
    ISAS, or one this CPU lacks, is refused with the variable's name."""
    if isa and isa not in ISAS:
        raise ValueError(f"{ISA_ENV} must be one of {', '.join(ISAS)}, not {isa!r}")
    try:
        kernels.set_linear_isa(isa)
    except RuntimeError as exc:
        raise ValueError(f"{ISA_ENV}={isa}: not on this CPU ({cpu_summary()})") from exc


def load_cpu_kernels(build_root: Path | None = None) -> CpuKernels | None:
    """Build (or reuse) the kernels; None, with a warning, where they cannot be built."""
    try:
        return build_cpu_kernels(build_root)
    except ValueError:  # KVSERVE_CPU_ISA names what this CPU cannot run: the user's to fix
        raise
    except Exception as exc:  # no compiler, no ninja, a read-only cache: torch ops still work
        log.warning("CPU kernels unavailable, running torch ops instead: %s", exc)
        return None


def kernels_isa(kernels: CpuKernels | None) -> str:
    """The instruction set the kernels' projections run ("avx512", "avx2"), or "none": torch's
    ops in their place (no kernels, or a CPU with neither)."""
    return (kernels.linear_isa() or "none") if kernels is not None else "none"


def fallback_note(kernels: CpuKernels | None, dtype: torch.dtype,
                  features: str | None = None) -> str | None:
    """What an engine on this CPU says once at its start where the kernels' projections cannot
    run `dtype` (a CPU with neither AVX2 + FMA nor AVX-512, such as Arm's, KVSERVE_CPU_ISA=none,
    or no kernels at all): what runs instead, and for bf16 on a CPU without bf16 instructions
    (`native_bf16`) that torch's bf16 matmuls crawl there. None where the kernels run `dtype`;
    `features`: `cpu_features()`'s text, for tests."""
    if kernels is not None and linear_available_for(kernels, dtype):
        return None
    text = cpu_features() if features is None else features
    notes = []
    if kernels is not None:  # (no kernels: `load_cpu_kernels` said why)
        why = (f"{ISA_ENV}=none" if os.environ.get(ISA_ENV) == "none"
               else f"{cpu_summary(text)} has neither AVX2 + FMA nor AVX-512")
        notes.append(f"kvserve: {why}: the projections run oneDNN's matmuls, and bf16's "
                     "norms and activations torch's ops")
    if dtype == torch.bfloat16 and not native_bf16(text):
        notes.append(f"kvserve: dtype bfloat16 on {cpu_summary(text)}, which has no bf16 "
                     "instructions (AVX512-BF16, AMX-BF16): torch multiplies bf16 in a scalar "
                     "fallback, ~100x slower than fp32 here; dtype float32 (or auto) is faster")
    return "; ".join(notes) or None


def linear_available_for(kernels: CpuKernels | None, dtype: torch.dtype) -> bool:
    """Whether `kernels` has a batch-invariant projection for weights and activations of `dtype`:
    fp32 `linear` or bf16 `linear_bf16` (AVX2 + FMA or AVX-512); other dtypes have none."""
    if kernels is None:
        return False
    if dtype == torch.float32:
        return bool(kernels.linear_available())
    if dtype == torch.bfloat16:
        return bool(kernels.bf16_linear_available())
    return False


def elementwise_available_for(kernels: CpuKernels | None, dtype: torch.dtype) -> bool:
    """Whether `kernels` runs `rms_norm`, `rotary_` and `silu_and_mul` (so `decode_layer`'s
    elementwise work) in `dtype`: fp32 always, bf16 where `linear_bf16` runs (AVX2 or AVX-512)."""
    if kernels is None:
        return False
    return dtype == torch.float32 or (dtype == torch.bfloat16
                                      and bool(kernels.bf16_linear_available()))


def build_dir_name(torch_version: str, features: str) -> str:
    """One build per torch, Python and CPU feature set: with -march=native, a build made on one
    node of a cluster sharing a home directory would die of an illegal instruction on an older
    one (no AVX-512, say)."""
    python = f"py{sys.version_info.major}{sys.version_info.minor}"
    cpu = hashlib.sha256(features.encode()).hexdigest()[:12]
    return f"torch-{torch_version}-{python}-cpu-{cpu}".replace("+", "_")


def cpu_features() -> str:
    """The CPU's model and instruction-set flags (Linux's /proc/cpuinfo: `flags` on x86,
    `Features` on Arm), else the platform's processor string."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor() or platform.machine()
    wanted = ("model name", "flags", "Features")
    return "\n".join(sorted({ln for ln in lines if ln.split(":")[0].strip() in wanted}))


# oneDNN's instruction sets without bf16 arithmetic: ONEDNN_MAX_CPU_ISA capped at one of them
# leaves torch's bf16 matmuls the scalar fallback, whatever the CPU has
ONEDNN_ISAS_WITHOUT_BF16 = {"SSE41", "AVX", "AVX2", "AVX2_VNNI", "AVX512_CORE",
                            "AVX512_CORE_VNNI"}


def native_bf16(features: str | None = None) -> bool:
    """torch multiplies bf16 in hardware here: the CPU has x86 AVX512-BF16 or AMX-BF16, or
    Arm's BF16 extension (`cpu_features()`, or `features`), and oneDNN is not capped below them
    (ONEDNN_MAX_CPU_ISA). Without it torch's bf16 matmuls are a scalar fallback: ~1-2 GFLOP/s
    against fp32's ~150 on an AVX2-only AMD EPYC."""
    if os.environ.get("ONEDNN_MAX_CPU_ISA", "").upper() in ONEDNN_ISAS_WITHOUT_BF16:
        return False
    flags = _flags(cpu_features() if features is None else features)
    return bool(flags & {"avx512_bf16", "amx_bf16", "bf16"})


def _flags(features: str) -> set[str]:
    """The instruction-set flags in `cpu_features()`'s text."""
    return {word for line in features.splitlines() if line.startswith(("flags", "Features"))
            for word in line.split(":", 1)[-1].split()}


def cpu_summary(features: str | None = None) -> str:
    """The CPU's model and the flags that decide its matmul rates (from `cpu_features()`, or
    `features`)."""
    text = cpu_features() if features is None else features
    model = next((ln.split(":", 1)[1].strip() for ln in text.splitlines()
                  if ln.startswith("model name")), "unknown CPU")
    flags = _flags(text)
    wanted = ("avx512f", "avx512_bf16", "avx512_fp16", "amx_bf16", "amx_tile", "avx2")
    return f"{model} [{' '.join(f for f in wanted if f in flags) or 'no AVX-512/AMX'}]"


def clear_stale_lock(build_dir: Path, now: float) -> bool:
    """Remove torch's build lock in `build_dir` if it is older than STALE_LOCK_S."""
    lock = build_dir / "lock"
    try:
        if now - lock.stat().st_mtime <= STALE_LOCK_S:
            return False
        lock.unlink()
    except FileNotFoundError:
        return False
    log.warning("removed a stale kernel build lock (%s)", lock)
    return True
