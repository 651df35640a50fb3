"""Triton's internals that compiling kvserve's kernels for a GPU without one needs, in one place.

Why here: the compile sweep (`kvserve bench gpu-compile`) must compile exactly what a launch on
a GPU would compile, with no GPU or driver. Triton's launch path asks the driver for the target,
so the sweep records the launches kvserve's own wrappers make (`recording_launches`), runs them
through the JIT's own argument binder for a chosen target (the same specialization a launch
gets: each argument's type, 16-byte alignment and divisibility, its constexprs and options),
and compiles with `triton.compile(ASTSource(...), target=GPUTarget(...))`, which needs only the
ptxas bundled in Triton's wheel. `triton.tools.compile` would need a driver.

These are private APIs (`JITFunction.run`, `create_function_from_signature`, `_pack_args`,
`knobs`): checked with triton 3.6.0 and 3.7.1. A version that moves them fails here, loudly.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any


@dataclass
class Launch:
    """One kernel launch a wrapper made: the kernel, its arguments, its grid."""

    fn: Any  # a triton JITFunction
    args: tuple
    kwargs: dict[str, Any]
    grid: Any

    @property
    def name(self) -> str:
        return self.fn.__name__


@contextlib.contextmanager
def recording_launches() -> Iterator[list[Launch]]:
    """Within: every `kernel[grid](...)` is recorded instead of run (outputs stay garbage)."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise RuntimeError("TRITON_INTERPRET=1 is set: kvserve's kernels were made for Triton's "
                           "interpreter and cannot be compiled; unset it")
    from triton.runtime import jit

    launches: list[Launch] = []

    def record(self, *args, grid, warmup, **kwargs):
        launches.append(Launch(self, args, dict(kwargs), grid))

    original = jit.JITFunction.run
    jit.JITFunction.run = record
    try:
        yield launches
    finally:
        jit.JITFunction.run = original


@dataclass
class Compiled:
    """What compiling one launch for one GPU gave."""

    name: str
    options: dict[str, Any]  # num_warps, num_stages, ...
    constexprs: dict[str, Any]  # by argument name
    ttir: str
    ptx: str
    cubin: bytes
    shared_dynamic: int  # bytes: what the launch asks for
    ptxas_log: str
    compile_s: float


def _capability_arch(capability: int) -> str:
    # Hopper's and Blackwell's wgmma/tcgen05 need the arch-specific "a" targets, as Triton does
    return f"sm_{capability}{'a' if capability >= 90 else ''}"


def compile_launch(launch: Launch, capability: int) -> Compiled:
    """Compile `launch` for an NVIDIA GPU of `capability` (80, 90, 100), as a launch on it would."""
    import triton
    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend
    from triton.compiler.compiler import ASTSource
    from triton.runtime import jit

    target = GPUTarget("cuda", capability, 32)
    backend = make_backend(target)
    fn = launch.fn
    binder = jit.create_function_from_signature(fn.signature, fn.params, backend)
    bound, specialization, options = binder(*launch.args, **launch.kwargs)
    options, signature, constexprs, attrs = fn._pack_args(backend, launch.kwargs, bound,
                                                          specialization, options)
    log = io.StringIO()
    with tempfile.TemporaryDirectory() as cache, contextlib.ExitStack() as stack:
        # a fresh cache: every configuration is compiled (and timed) here, and ptxas's log
        # (registers, spills) is only printed by a compile that ran
        for group in (knobs.cache, knobs.compilation, knobs.nvidia):
            stack.enter_context(group.scope())  # restores the knobs and their variables
        knobs.cache.dir = cache
        knobs.compilation.always_compile = True
        knobs.nvidia.dump_ptxas_log = True
        start = time.perf_counter()
        with contextlib.redirect_stdout(log):
            kernel = triton.compile(ASTSource(fn, signature, constexprs, attrs), target=target,
                                    options=options.__dict__)
        seconds = time.perf_counter() - start
    names = {path[0]: value for path, value in constexprs.items() if len(path) == 1}
    return Compiled(
        name=fn.__name__,
        options={"num_warps": options.num_warps, "num_stages": options.num_stages},
        constexprs={fn.arg_names[i]: _plain(v) for i, v in sorted(names.items())},
        ttir=kernel.asm["ttir"], ptx=kernel.asm["ptx"], cubin=kernel.asm["cubin"],
        shared_dynamic=int(kernel.metadata.shared), ptxas_log=log.getvalue(),
        compile_s=seconds)


def _plain(value: Any) -> Any:
    value = getattr(value, "value", value)  # tl.constexpr
    return value if isinstance(value, (int, float, bool, str, type(None))) else str(value)


def _nvidia_bin(tool: str) -> str:
    import triton

    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", tool)


def ptxas_version(capability: int) -> str:
    """The release of the ptxas Triton uses for `capability` (it bundles one per generation)."""
    from triton.backends.nvidia.compiler import get_ptxas

    out = subprocess.run([get_ptxas(capability).path, "--version"], capture_output=True,
                         text=True, check=True).stdout
    found = re.search(r"release ([\d.]+)", out)
    return found.group(1) if found else out.strip().splitlines()[-1]


@dataclass(frozen=True)
class ResourceUsage:
    """A compiled kernel's per-thread registers and per-block static shared memory (cuobjdump),
    its stack and spills (ptxas's log)."""

    registers: int
    shared_static: int
    local_bytes: int  # local memory per thread: spills and stack arrays
    spill_stores: int
    spill_loads: int
    stack_frame: int


def resource_usage(compiled: Compiled) -> ResourceUsage:
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.cubin)
        f.flush()
        dump = subprocess.run([_nvidia_bin("cuobjdump"), "--dump-resource-usage", f.name],
                              capture_output=True, text=True, check=True).stdout
    usage = dict(re.findall(r"\b(REG|SHARED|LOCAL):(\d+)", dump))
    log = compiled.ptxas_log
    frame = re.search(r"(\d+) bytes stack frame", log)
    stores = re.search(r"(\d+) bytes spill stores", log)
    loads = re.search(r"(\d+) bytes spill loads", log)
    if not (frame and stores and loads and usage):
        raise RuntimeError(f"no resource usage for {compiled.name}: ptxas said {log!r}")
    return ResourceUsage(
        registers=int(usage["REG"]), shared_static=int(usage.get("SHARED", 0)),
        local_bytes=int(usage.get("LOCAL", 0)), spill_stores=int(stores.group(1)),
        spill_loads=int(loads.group(1)), stack_frame=int(frame.group(1)))
