"""`kvserve bench throughput|cpu|prefix|serve|speculative|structured|sampling`: kvserve against
peer baselines; `kvserve bench machine`: the machine's own rates, which those numbers depend on;
`kvserve bench gpu-compile`: every Triton kernel configuration compiled for GPUs, without one."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from kvserve.cli.engine_args import add_engine_args, engine_config
from kvserve.cli.types import positive_ints, words
from kvserve.workers.config import output_dir


def add_bench(sub) -> None:
    p = sub.add_parser("bench", help="benchmarks against peer baselines")
    bench = p.add_subparsers(title="benchmarks")
    t = bench.add_parser(
        "throughput",
        help="kvserve's engine vs HF generate() and generate_batch(), same model and prompts",
        description="Output tokens/s of kvserve's engine, HF generate() one request at a time "
                    "and HF generate_batch(), plus batch-1 decode ms/token vs the memory-"
                    "bandwidth limit (weight bytes / a sum() over a fresh 512 MB buffer, probed "
                    "just before and after the decode) and vs a sum() over the model's own "
                    "weights. HF runs in the engine's --dtype; with bfloat16 on a CPU a float32 "
                    "kvserve engine runs the same workload beside it. Each kvserve run also "
                    "reports the share of its time its projections alone take (a mixture of "
                    "experts' router and experts included; the rest: attention, norms, "
                    "sampling, scheduling, Python). With "
                    "--tensor-parallel-size N > 1 a tp 1 engine and a tp N engine on the other "
                    "--tp-step-channel run the same workload, and each tp N run reports per "
                    "step the step plan's send time and latency to the other ranks and the "
                    "all-reduces' and the logits' gather's time and bytes.",
    )
    _add_workload_args(t, output_len=128)
    t.add_argument("--hf-sequential-requests", type=int, default=4,
                   help="HF generate() is slow: time this many requests, report tok/s")
    t.add_argument("--skip-hf", action="store_true", help="only measure kvserve")
    t.add_argument("--repeats", type=int, default=1,
                   help="rounds, each timing every contender in turn; each reports its best "
                        "round (a shared machine's slow rounds measure its neighbours)")
    t.add_argument("--json", action="store_true",
                   help="print one JSON object (kvserve_tok_s, hf_generate_tok_s, "
                        "hf_generate_batch_tok_s, decode_ms_per_token, "
                        "bandwidth_limit_ms_per_token, decode_vs_bandwidth_limit, "
                        "weights_read_ms, matmul_share, speedups, with a reduced dtype on "
                        "CPU fp32_kvserve_tok_s, fp32_matmul_share, speedup_vs_fp32; with "
                        "tp > 1 tp1_tok_s and tp_<channel>_* per step; runs: every round's "
                        "numbers)")
    add_engine_args(t)
    t.set_defaults(run=_run_bench_throughput)
    _add_bench_cpu(bench)
    _add_bench_serve(bench)
    _add_bench_prefix(bench)
    _add_bench_speculative(bench)
    _add_bench_structured(bench)
    _add_bench_sampling(bench)
    _add_bench_machine(bench)
    _add_bench_gpu_compile(bench)


def _add_bench_gpu_compile(bench) -> None:
    b = bench.add_parser(
        "gpu-compile",
        help="compile every Triton kernel configuration for sm_80/sm_90/sm_100, no GPU needed",
        description="Compile every Triton kernel configuration kvserve can launch (attention "
                    "decode, its merge and prefill; RoPE with the KV write; RMSNorm with and "
                    "without the residual; SiLU-and-mul) for each model shape and "
                    "tensor-parallel rank size, dtype and KV block size, for each GPU, with "
                    "Triton's bundled ptxas and no GPU or driver. Each compiled kernel is "
                    "checked: shared memory (dynamic + static) within the GPU's per-block "
                    "limit, no register spills, and tensor-core instructions in every tl.dot "
                    "kernel of a 16-bit model. Prints a table per GPU, kernel and dtype, and "
                    "every failing configuration; exits 1 if any fails. Takes ~5 minutes on "
                    "2 cores for everything; --ci is the subset `make test` compiles.")
    b.add_argument("--shapes", type=words, default=None,
                   help="model shapes, comma-separated (default: all; see --list)")
    b.add_argument("--dtypes", type=words, default=None,
                   help="bfloat16,float16,float32 (default: all three)")
    b.add_argument("--block-sizes", type=positive_ints, default=None,
                   help="KV block sizes (default 16,32,256)")
    b.add_argument("--gpus", type=words, default=None,
                   help="targets: sm_80, sm_86, sm_89, sm_90, sm_100 (default sm_80,sm_90,sm_100)")
    b.add_argument("--tp", type=positive_ints, default=None,
                   help="only these tensor-parallel sizes (default: each shape's own, those "
                        "that divide its heads, up to 8)")
    b.add_argument("--kernels", type=words, default=None,
                   help="only these kernels, comma-separated (default: all; names as in the "
                        "table, e.g. 'attention prefill,rms_norm')")
    b.add_argument("--ci", action="store_true",
                   help="what `make test` compiles: the engine's picks for SmolLM2-135M and "
                        "Llama-3.2-1B's shape at tp 1 (and the 1B at tp 2), bfloat16 (the default "
                        "on CUDA), block 16, on sm_90")
    b.add_argument("--jobs", type=int, default=os.cpu_count() or 1,
                   help="compiles at a time, each in its own process (default: the CPUs)")
    b.add_argument("--triton", metavar="VERSION", default=None,
                   help="compile with this Triton release instead of the installed one (e.g. "
                        "3.6.0, what the lent GPU machines have): pip installs it once into "
                        "kvserve's cache, beside the venv, and reruns this command with it")
    b.add_argument("--out", type=Path, default=output_dir("gpu-compile") / "report.json",
                   help="the JSON report's file (default: report.json in kvserve's cache, "
                        "$KVSERVE_CACHE_DIR/outputs/gpu-compile)")
    b.add_argument("--json", action="store_true",
                   help="print one JSON object: date, command, versions (triton, ptxas per "
                        "GPU, cpu), settings, gpus, summary, rows (one per configuration and "
                        "GPU: shared_bytes, shared_limit, registers, spill_stores, "
                        "spill_loads, blocks_per_sm, tensor_core_ops, compile_s, ok, problems)")
    b.add_argument("--all", action="store_true",
                   help="list every configuration, not only the failing ones")
    b.add_argument("--dot-fp32", action="store_true",
                   help="a negative control: force the attention kernels' tl.dot to fp32 FMA "
                        "(what the CPU interpreter runs); every 16-bit attention "
                        "configuration must then fail the tensor-core check")
    b.add_argument("--list", action="store_true", help="print the model shapes and exit")
    b.set_defaults(run=_run_bench_gpu_compile)


def _run_bench_gpu_compile(args: argparse.Namespace) -> int:
    if args.triton:
        return _rerun_with_triton(args.triton)
    from kvserve.bench import gpu_compile

    if args.list:
        for name, shape in gpu_compile.SHAPES.items():
            print(f"{name}: {shape}")
        return 0
    chosen = {
        "--shapes": (args.shapes or (list(gpu_compile.CI_SHAPES) if args.ci
                                     else list(gpu_compile.SHAPES)), gpu_compile.SHAPES),
        "--dtypes": (args.dtypes or (["bfloat16"] if args.ci
                                     else list(gpu_compile.DTYPES)), gpu_compile.DTYPES),
        "--gpus": (args.gpus or (["sm_90"] if args.ci else list(gpu_compile.DEFAULT_GPUS)),
                   gpu_compile.GPUS),
    }
    if args.kernels:
        chosen["--kernels"] = (args.kernels, gpu_compile.KERNELS)
    for flag, (values, known) in chosen.items():
        unknown = [v for v in values if v not in known]
        if unknown:
            print(f"kvserve bench gpu-compile: error: {flag}: unknown {', '.join(unknown)} "
                  f"(known: {', '.join(known)})", file=sys.stderr)
            return 2
    return gpu_compile.main(
        chosen["--shapes"][0], chosen["--dtypes"][0],
        args.block_sizes or ([16] if args.ci else list(gpu_compile.BLOCK_SIZES)),
        chosen["--gpus"][0], jobs=max(1, args.jobs), out=args.out, as_json=args.json,
        dot_fp32=args.dot_fp32, show_all=args.all,
        tp_sizes=args.tp or ([1, 2] if args.ci else None), kernels=args.kernels)


def _rerun_with_triton(version: str) -> int:
    """This command again, in a new process that imports Triton `version` from kvserve's cache
    (installed there once, with no dependencies: Triton needs none of its own)."""
    import subprocess

    from kvserve.workers.config import cache_root

    target = cache_root() / "triton" / version
    if not (target / "triton" / "__init__.py").exists():
        print(f"installing triton=={version} into {target}", file=sys.stderr)
        subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps",
                        "--target", str(target), f"triton=={version}"], check=True)
    argv, skip = [], False
    for arg in sys.argv[1:]:
        if skip:
            skip = False
        elif arg == "--triton":
            skip = True
        elif not arg.startswith("--triton="):
            argv.append(arg)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        p for p in (str(target), os.environ.get("PYTHONPATH")) if p)}
    return subprocess.run([sys.executable, "-m", "kvserve", *argv], env=env).returncode


def _add_bench_machine(bench) -> None:
    b = bench.add_parser(
        "machine", help="this machine's memory bandwidth and GEMM rates, now (~3 s)",
        description="Measure the rates other numbers depend on, as they are right now on this "
                    "(possibly shared) machine: memory read bandwidth (a sum() over a fresh "
                    "512 MiB buffer: batch-1 decode's bound), fp32 and bf16 GEMM GFLOP/s "
                    "(1024 x 1024 x 1024: prefill's and large batches' bound), with torch's "
                    "threads, a bare Python loop's ns/iteration (what interpreter-bound work "
                    "runs at: scheduling, Ray, gRPC, most tests), and the share of CPU time "
                    "the hypervisor stole meanwhile. Quote benchmark numbers and CI times with "
                    "it.")
    b.add_argument("--json", action="store_true",
                   help="print one JSON object (cpu, threads, memory_read_gb_s, "
                        "fp32_gemm_gflop_s, bf16_gemm_gflop_s, python_loop_ns, stolen_pct)")
    b.set_defaults(run=_run_bench_machine)


def _run_bench_machine(args: argparse.Namespace) -> int:
    from kvserve.bench.machine import measure_machine

    gauge = measure_machine()
    print(json.dumps(gauge.to_dict()) if args.json else gauge.summary())
    return 0


def _add_bench_structured(bench) -> None:
    b = bench.add_parser(
        "structured", help="structured outputs: tok/s with a JSON schema vs unconstrained",
        description="Output tokens/s of the in-process engine with a JSON schema (a long list "
                    "of records, so every request runs --output-len tokens) against the same "
                    "requests unconstrained (ignoring EOS), at batch 1 and 32, in one run; "
                    "and the mask's own time per step (filling the bitmask, applying it).")
    _add_alternating_modes_args(b)
    b.add_argument("--json", action="store_true",
                   help="print one JSON object: rows (batch, unconstrained and json_schema "
                        "tok_s, mask_ms_per_step, mask_share, ratio), weights_read_ms")
    add_engine_args(b)
    b.set_defaults(run=_run_bench_structured)


def _add_alternating_modes_args(b: argparse.ArgumentParser) -> None:
    """The flags of the benchmarks that alternate modes on one engine (structured, sampling)."""
    b.add_argument("--output-len", type=int, default=64,
                   help="tokens per request in every mode (default 64)")
    b.add_argument("--repeats", type=int, default=2,
                   help="rounds, modes alternating; each mode reports its best (default 2)")
    b.add_argument("--batch-sizes", type=positive_ints, default=(1, 32), metavar="N,N",
                   help="requests side by side (default 1,32)")


def _run_bench_structured(args: argparse.Namespace) -> int:
    from kvserve.bench.structured import run_structured_bench

    report = run_structured_bench(engine_config(args), output_len=args.output_len,
                                  repeats=args.repeats, batch_sizes=tuple(args.batch_sizes),
                                  progress=not args.json)
    print(json.dumps(report, indent=2) if args.json else report["summary"])
    return 0


def _add_bench_sampling(bench) -> None:
    b = bench.add_parser(
        "sampling", help="top-p/top-k sampling vs greedy: tok/s, and the sampler vs a full sort",
        description="Output tokens/s of the in-process engine on the same chats, greedy, "
                    "sampled (temperature, top-p, top-k), and sampled with top-k/top-p by a "
                    "sort of the whole vocabulary (what the sampler does on a GPU, and did on "
                    "a CPU before it tried each row's most likely tokens first), at batch 1 and "
                    "32, modes alternating, in one run.")
    _add_alternating_modes_args(b)
    b.add_argument("--temperature", type=float, default=0.8, help="(default 0.8)")
    b.add_argument("--top-p", type=float, default=0.95, help="(default 0.95)")
    b.add_argument("--top-k", type=int, default=0, help="(default 0: off)")
    b.add_argument("--json", action="store_true",
                   help="print one JSON object: rows (batch; greedy, sampled and "
                        "sampled_full_sort tok_s; sampled_vs_greedy, full_sort_vs_greedy, "
                        "speedup_vs_full_sort, sampled_equals_full_sort)")
    add_engine_args(b)
    b.set_defaults(run=_run_bench_sampling)


def _run_bench_sampling(args: argparse.Namespace) -> int:
    from kvserve.bench.sampling import run_sampling_bench

    sampling = {"temperature": args.temperature, "top_p": args.top_p, "top_k": args.top_k}
    report = run_sampling_bench(engine_config(args), output_len=args.output_len,
                                repeats=args.repeats, batch_sizes=tuple(args.batch_sizes),
                                sampling=sampling, progress=not args.json)
    print(json.dumps(report, indent=2) if args.json else report["summary"])
    return 0


def _add_bench_speculative(bench) -> None:
    b = bench.add_parser(
        "speculative", help="speculative decoding on vs off: output tok/s at batch 1 and 8",
        description="Output tokens/s of the in-process engine without and with speculative "
                    "decoding (the engine flags' --speculative-method; ngram when unset), at "
                    "batch 1 and batch 8, on input-grounded workloads (the grounded factuality "
                    "reports, 'rewrite this function' code edits, quoting summaries) and "
                    "open-ended chat. Greedy: both engines must write the same tokens, and the "
                    "report says whether they did. Prints the speedup end to end and of the "
                    "decode phase, the acceptance rate and the mean accepted length.")
    b.add_argument("--output-len", type=int, default=128,
                   help="most tokens per answer (greedy, stops at EOS; default 128)")
    b.add_argument("--requests", type=int, default=8,
                   help="conversations per workload, run one at a time at batch 1 and in "
                        "groups at larger batches (default 8)")
    b.add_argument("--repeats", type=int, default=1,
                   help="rounds; each engine reports its best round per cell (default 1)")
    b.add_argument("--json", action="store_true",
                   help="print one JSON object: rows (workload, batch, plain and speculative "
                        "tok_s, decode_tok_s, acceptance_rate, mean_accepted_length, speedup, "
                        "decode_speedup, outputs_identical), weights_read_ms, the settings")
    add_engine_args(b)
    b.set_defaults(run=_run_bench_speculative)


def _run_bench_speculative(args: argparse.Namespace) -> int:
    from kvserve.bench.speculative import run_speculative_bench

    report = run_speculative_bench(engine_config(args), output_len=args.output_len,
                                   repeats=args.repeats, requests=args.requests,
                                   progress=not args.json)
    print(json.dumps(report, indent=2) if args.json else report["summary"])
    return 0 if report["outputs_identical"] else 1


def _add_bench_prefix(bench) -> None:
    b = bench.add_parser(
        "prefix", help="multi-turn chats: prefix caching on vs off, host KV tier on vs off",
        description="Multi-turn chats with a growing history, in-process, four settings: no "
                    "caching vs prefix caching (time to first token per turn, p50), and under "
                    "memory pressure (a device pool holding --pool-fraction of the working "
                    "set) the host KV tier vs recompute-only (output tokens/s). Prints the "
                    "ratios ttft_last_turn_ratio and pressure_throughput_ratio.")
    b.add_argument("--conversations", type=int, default=8,
                   help="chats, run side by side (default 8)")
    b.add_argument("--turns", type=int, default=5, help="turns per chat (default 5)")
    b.add_argument("--history-tokens", type=int, default=1500,
                   help="tokens of each chat's first message (its growing history's start)")
    b.add_argument("--output-len", type=int, default=16, help="tokens per answer (greedy)")
    b.add_argument("--pool-fraction", type=float, default=0.25,
                   help="device KV pool under pressure, as a fraction of the working set")
    b.add_argument("--json", action="store_true",
                   help="print one JSON object (settings, ttft_last_turn_ratio, "
                        "pressure_throughput_ratio, outputs_identical, config)")
    add_engine_args(b)
    b.set_defaults(run=_run_bench_prefix)


def _run_bench_prefix(args: argparse.Namespace) -> int:
    from kvserve.bench.prefix import run_prefix_bench

    report = run_prefix_bench(
        engine_config(args), conversations=args.conversations, turns=args.turns,
        history_tokens=args.history_tokens, output_len=args.output_len,
        pool_fraction=args.pool_fraction, progress=not args.json)
    print(json.dumps(report, indent=2) if args.json else report["summary"])
    return 0


def _run_bench_throughput(args: argparse.Namespace) -> int:
    from kvserve.bench.throughput import run_throughput_bench

    report = run_throughput_bench(
        engine_config(args), requests=args.requests, prompt_len=args.prompt_len,
        output_len=args.output_len, hf_sequential_requests=args.hf_sequential_requests,
        skip_hf=args.skip_hf, repeats=args.repeats, progress=not args.json,
    )
    print(json.dumps(report, indent=2) if args.json else report["summary"])
    return 0


def _add_workload_args(p: argparse.ArgumentParser, output_len: int) -> None:
    """The requests a throughput benchmark submits at once: --requests x (--prompt-len +
    --output-len) tokens."""
    p.add_argument("--requests", type=int, default=32, help="requests (default 32)")
    p.add_argument("--prompt-len", type=int, default=128,
                   help="prompt tokens each (default 128)")
    p.add_argument("--output-len", type=int, default=output_len,
                   help=f"output tokens each (default {output_len})")


def _add_bench_cpu(bench) -> None:
    c = bench.add_parser(
        "cpu",
        help="kvserve on a CPU vs llama.cpp on the same GGUF file and threads, and HF",
        description="In one process, with the same thread count: kvserve's batch-1 decode "
                    "(ms/token) and prompt rate (tok/s of one --prompt-len prompt) beside "
                    "llama.cpp's on the very same GGUF file (llama-cpp-python: pip install "
                    "'kvserve[bench]', built from source; skipped with a note where it is "
                    "missing or the model is not a GGUF), and kvserve's --requests x "
                    "(--prompt-len + --output-len) output tok/s beside HF generate_batch() and "
                    "llama.cpp's batch-1 rate. The physical bound: the time to read the block "
                    "codes once at the memory bandwidth measured around the decode, and the "
                    "fp32 weights' beside it. Every figure is its best of --repeats rounds.",
    )
    _add_workload_args(c, output_len=64)
    c.add_argument("--decode-tokens", type=int, default=64,
                   help="tokens each batch-1 decode is timed over (default 64)")
    c.add_argument("--repeats", type=int, default=2, help="rounds (default 2)")
    c.add_argument("--skip-hf", action="store_true", help="no HF generate_batch()")
    c.add_argument("--skip-llama-cpp", action="store_true", help="no llama.cpp")
    c.add_argument("--json", action="store_true",
                   help="print one JSON object (kvserve_decode_ms_per_token, "
                        "kvserve_prompt_tok_s, kvserve_tok_s, llama_cpp_decode_ms_per_token, "
                        "llama_cpp_prompt_tok_s, hf_generate_batch_tok_s, codes_read_ms, "
                        "fp32_read_ms, the ratios, config; runs: every round's numbers)")
    add_engine_args(c)
    c.set_defaults(run=_run_bench_cpu)


def _run_bench_cpu(args: argparse.Namespace) -> int:
    from kvserve.bench.cpu import run_cpu_bench

    report = run_cpu_bench(
        engine_config(args), requests=args.requests, prompt_len=args.prompt_len,
        output_len=args.output_len, decode_tokens=args.decode_tokens, repeats=args.repeats,
        skip_hf=args.skip_hf, skip_llama_cpp=args.skip_llama_cpp, progress=not args.json)
    print(json.dumps(report, indent=2) if args.json else report["summary"])
    return 0


def _add_bench_serve(bench) -> None:
    s = bench.add_parser(
        "serve",
        help="a running service over gRPC or HTTP vs the in-process engine: tok/s, TTFT, ITL",
        description="Drive a running kvserve service (e.g. `kvserve up`) over gRPC (Ray Serve's "
                    "gRPC proxy) or HTTP (the OpenAI-compatible /v1/completions, streamed) "
                    "with N greedy "
                    "requests (random prompt token ids, ignore_eos, exactly --output-len tokens "
                    "each) at each concurrency level, then run the same workload on an "
                    "in-process engine built like a replica (model from the ModelInfo RPC or "
                    "/v1/models). "
                    "Prints output tokens/s of both and their ratio (service/engine), time to "
                    "first token and inter-token latency (p50/p99, ms) per level.",
    )
    s.add_argument("--target", required=True, metavar="HOST:PORT",
                   help="the service's gRPC address (e.g. 127.0.0.1:50051), or with --protocol "
                        "http its HTTP address (e.g. http://127.0.0.1:8000)")
    s.add_argument("--protocol", choices=["grpc", "http"], default="grpc",
                   help="gRPC (default) or the OpenAI-compatible HTTP API")
    s.add_argument("--concurrency", type=positive_ints, default=[1, 8, 32], metavar="N,N,...",
                   help="streams in flight at once, one level each (default 1,8,32)")
    s.add_argument("--requests", type=int, default=64, help="requests per level (default 64)")
    s.add_argument("--prompt-len", type=int, default=128, help="prompt tokens (default 128)")
    s.add_argument("--output-len", type=int, default=128, help="output tokens (default 128)")
    s.add_argument("--engine-threads", type=int, default=1,
                   help="torch threads of the in-process engine; match the replica's CPUs "
                        "(Ray gives a replica num_cpus_per_replica threads, 1 by default); "
                        "0: torch's default")
    s.add_argument("--skip-engine", action="store_true",
                   help="only measure the service (no in-process engine, no ratio)")
    s.add_argument("--json", action="store_true",
                   help="print one JSON object: levels (concurrency, service_tok_s, engine_tok_s, "
                        "ratio, ttft_p50_ms, ttft_p99_ms, itl_p50_ms, itl_p99_ms, ...) and config")
    s.set_defaults(run=_run_bench_serve)


def _run_bench_serve(args: argparse.Namespace) -> int:
    import grpc

    from kvserve.bench.serve import run_serve_bench, summarize
    from kvserve.cluster.http_client import HTTPStatusError

    try:
        report = run_serve_bench(
            args.target, concurrency=args.concurrency, requests=args.requests,
            prompt_len=args.prompt_len, output_len=args.output_len,
            skip_engine=args.skip_engine, engine_threads=args.engine_threads,
            progress=not args.json, protocol=args.protocol)
    except grpc.RpcError as exc:
        print(f"kvserve: {exc.code().name}: {exc.details()}", file=sys.stderr)
        return 1
    except (HTTPStatusError, OSError) as exc:
        print(f"kvserve: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(report.to_dict(), indent=2) if args.json else summarize(report))
    return 0
