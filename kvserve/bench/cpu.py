"""`kvserve bench cpu`: kvserve on a CPU against llama.cpp on the very same GGUF file, and
against transformers, in one process, with the same thread count.

The default model ships as a GGUF (Q4_1 projections, a Q8_0 embedding), so llama.cpp runs the
same file: its batch-1 decode and prompt processing are the CPU peer's rates. kvserve computes
in fp32 from the same block codes (`linear_codes`), so the physical bound of a batch-1 decode
step is reading those codes once; the fp32 weights' read time is printed beside it, as the
bound kvserve would have without them. transformers' `generate_batch()` (its continuous
batching) is the peer at 32 requests.

llama.cpp comes from the `llama-cpp-python` package (built from source with cmake, ~10 minutes
on 2 cores: `pip install 'kvserve[bench]'`), kept out of the default install; without it the
bench says so and measures the rest.
"""

from __future__ import annotations

import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from kvserve.bench.baselines import (
    decode_step_weights,
    hf_generate_batch,
    load_hf_model,
    measure_memory_bandwidth,
    weight_bytes_per_decode_step,
    weights_read_seconds,
)
from kvserve.bench.common import make_prompts
from kvserve.bench.machine import gemm_gflop_s
from kvserve.bench.throughput import batch1_decode_ms, kvserve_throughput
from kvserve.workers.config import EngineConfig
from kvserve.workers.engine import LLMEngine
from kvserve.workers.model_executor.cpu_kernels import cpu_summary
from kvserve.workers.model_executor.loader import gguf_file
from kvserve.workers.model_executor.model import Linear

LLAMA_CPP_INSTALL = "pip install 'kvserve[bench]' (llama-cpp-python, built from source)"


@dataclass
class LlamaCppRates:
    """llama.cpp's batch-1 rates on one GGUF file: a `prompt_len`-token prompt processed in one
    call, then `decode_tokens` tokens decoded one call each, greedy (argmax of its logits)."""

    prompt_tok_s: float
    decode_ms_per_token: float
    threads: int
    version: str


def llama_cpp_rates(gguf: Path, prompt: list[int], decode_tokens: int,
                    threads: int) -> LlamaCppRates:
    """Times llama.cpp on `gguf` (raises ImportError without llama-cpp-python). Wall time
    around each call, greedy sampling included, as kvserve's batch-1 decode is timed."""
    import llama_cpp
    import numpy as np

    llm = llama_cpp.Llama(model_path=str(gguf), n_threads=threads, n_threads_batch=threads,
                          n_ctx=len(prompt) + decode_tokens + 8, n_batch=max(512, len(prompt)),
                          verbose=False)
    try:
        llm.eval(prompt[:8])  # first touch of the weights and thread start-up stay out
        llm.reset()
        start = time.perf_counter()
        llm.eval(prompt)
        prompt_s = time.perf_counter() - start
        token = int(np.argmax(llm.scores[llm.n_tokens - 1]))
        start = time.perf_counter()
        for _ in range(decode_tokens):
            llm.eval([token])
            token = int(np.argmax(llm.scores[llm.n_tokens - 1]))
        decode_s = time.perf_counter() - start
    finally:
        llm.close()
    return LlamaCppRates(len(prompt) / prompt_s, decode_s * 1000 / decode_tokens, threads,
                         llama_cpp.__version__)


def kvserve_prompt_tok_s(engine: LLMEngine, prompt: list[int]) -> float:
    """A lone prompt's prefill (and its first token), as llama.cpp's prompt rate is timed."""
    engine.add_request(prompt_token_ids=prompt, params={"temperature": 0.0, "max_tokens": 1})
    start = time.perf_counter()
    while engine.has_unfinished():
        engine.step()
    return len(prompt) / (time.perf_counter() - start)


def fp32_weight_bytes(model: torch.nn.Module) -> int:
    """The bytes a decode step would read with every weight in fp32 (what the block codes
    replace): each projection's in x out (+ bias) floats, every other weight as stored, widened
    to 4 bytes an element."""
    total, in_linear = 0, set()
    for module in model.modules():
        if isinstance(module, Linear):
            total += 4 * module.out_features * (module.in_features + (module.bias is not None))
            in_linear.update(id(t) for t in module.parameters(recurse=False))
    return total + sum(4 * t.numel() for t in decode_step_weights(model) if id(t) not in in_linear)


def projection_flops(model: torch.nn.Module, tokens: int, sampled: int) -> float:
    """The multiply-adds (x2) of every projection over `tokens` tokens, the LM head's over the
    `sampled` rows it computes (a prefill samples only its last token)."""
    head = model.lm_head
    per_token = sum(m.in_features * m.out_features for m in model.modules()
                    if isinstance(m, Linear) and m is not head)
    return 2.0 * (per_token * tokens + head.in_features * head.out_features * sampled)


def run_cpu_bench(config: EngineConfig, requests: int = 32, prompt_len: int = 128,
                  output_len: int = 64, decode_tokens: int = 64, repeats: int = 2,
                  skip_hf: bool = False, skip_llama_cpp: bool = False,
                  progress: bool = True) -> dict[str, Any]:
    """Every contender once per round, in turn, for `repeats` rounds; each reports its best
    round (a shared machine's slow rounds measure its neighbours)."""
    if repeats < 1:
        raise ValueError("repeats must be at least 1")
    say = (lambda msg: print(f"[bench] {msg}", file=sys.stderr, flush=True)) if progress else (
        lambda msg: None)
    engine = LLMEngine(config)
    if engine.device.type != "cpu":
        raise ValueError(f"bench cpu runs on a CPU, not device {engine.device}")
    threads = torch.get_num_threads()
    prompts = make_prompts(engine.vocab_size, requests, prompt_len)
    gguf = gguf_file(config.model)
    llama_why = ("--skip-llama-cpp" if skip_llama_cpp
                 else "the model is not a GGUF file" if gguf is None else None)
    if llama_why is None:
        try:
            import llama_cpp  # noqa: F401
        except ImportError:
            llama_why = f"llama-cpp-python is not installed: {LLAMA_CPP_INSTALL}"
    if llama_why:
        say(f"llama.cpp skipped: {llama_why}")
    say("warming up kvserve")
    kvserve_throughput(engine, prompts[:2], 4)
    hf_model = None if skip_hf else load_hf_model(engine.model_path, dtype=engine.dtype)
    runs: dict[str, list[float]] = {}

    def keep(key: str, value: float) -> None:
        runs.setdefault(key, []).append(value)

    llama: LlamaCppRates | None = None
    for round_ in range(1, repeats + 1):
        say(f"round {round_}/{repeats}: kvserve batch 1, memory bandwidth before and after")
        bandwidth = measure_memory_bandwidth()
        keep("kvserve_decode_ms_per_token",
             batch1_decode_ms(engine, prompts[0], decode_tokens))
        keep("bandwidth_gb_s", max(bandwidth, measure_memory_bandwidth()) / 1e9)
        keep("kvserve_prompt_tok_s", kvserve_prompt_tok_s(engine, prompts[1 % requests]))
        keep("weights_read_ms", weights_read_seconds(engine.model) * 1000)
        say(f"kvserve: {requests} requests x {prompt_len} prompt + {output_len} output")
        keep("kvserve_tok_s", kvserve_throughput(engine, prompts, output_len, progress))
        if llama_why is None:
            say(f"llama.cpp {gguf.name}: batch 1, {threads} threads")
            rates = llama_cpp_rates(gguf, prompts[0], decode_tokens, threads)
            keep("llama_cpp_decode_ms_per_token", rates.decode_ms_per_token)
            keep("llama_cpp_prompt_tok_s", rates.prompt_tok_s)
            llama = rates
        if hf_model is not None:
            say(f"HF generate_batch(): {requests} requests")
            keep("hf_generate_batch_tok_s",
                 hf_generate_batch(hf_model, prompts, output_len).tok_s)
    report = _best(runs)
    codes_bytes = weight_bytes_per_decode_step(engine.model)
    fp32_bytes = fp32_weight_bytes(engine.model)
    bandwidth = report["bandwidth_gb_s"] * 1e9
    report.update({
        "weight_bytes_per_step": codes_bytes, "fp32_weight_bytes_per_step": fp32_bytes,
        "codes_read_ms": codes_bytes / bandwidth * 1000,
        "fp32_read_ms": fp32_bytes / bandwidth * 1000,
    })
    report["decode_vs_codes_read"] = report["kvserve_decode_ms_per_token"] / report[
        "codes_read_ms"]
    report["decode_vs_weights_read"] = report["kvserve_decode_ms_per_token"] / report[
        "weights_read_ms"]
    if "hf_generate_batch_tok_s" in report:
        report["speedup_vs_hf_generate_batch"] = (report["kvserve_tok_s"]
                                                  / report["hf_generate_batch_tok_s"])
    if llama is not None:
        llama_decode = report["llama_cpp_decode_ms_per_token"]
        report["decode_speed_vs_llama_cpp"] = llama_decode / report[
            "kvserve_decode_ms_per_token"]
        report["prompt_speed_vs_llama_cpp"] = (report["kvserve_prompt_tok_s"]
                                               / report["llama_cpp_prompt_tok_s"])
        report["throughput_vs_llama_cpp_batch1"] = report["kvserve_tok_s"] / (
            1000 / llama_decode)
    # the arithmetic bound at 32 requests: their projections' FLOPs at this machine's fp32 GEMM
    # rate (oneDNN's, a square matmul), the best the rest of the step could leave them
    gemm = gemm_gflop_s(torch.float32) * 1e9
    flops = projection_flops(engine.model, requests * (prompt_len + output_len - 1),
                             requests * output_len)
    report.update({"fp32_gemm_gflop_s": gemm / 1e9, "projection_tflop": flops / 1e12,
                   "arithmetic_bound_tok_s": requests * output_len / (flops / gemm)})
    report["throughput_vs_arithmetic_bound"] = (report["kvserve_tok_s"]
                                                / report["arithmetic_bound_tok_s"])
    report["runs"] = runs
    report["config"] = {
        "model": engine.info.name, "gguf": gguf.name if gguf else None,
        "dtype": engine.info.dtype, "requests": requests, "prompt_len": prompt_len,
        "output_len": output_len, "decode_tokens": decode_tokens, "repeats": repeats,
        "threads": threads, "cpu": cpu_summary(), "kvserve_isa": engine.info.cpu_isa,
        "weight_codes": config.weight_codes,
        "llama_cpp": asdict(llama) if llama else None, "llama_cpp_skipped": llama_why,
        "torch": torch.__version__,
    }
    report["summary"] = summarize(report)
    return report


def _best(runs: dict[str, list[float]]) -> dict[str, float]:
    """Each figure's best round: the highest rate, the lowest time; the bandwidth of the round
    whose batch-1 decode is reported (decode and bound from the same moment)."""
    lower = ("_ms_per_token", "_ms")
    best = {key: (min(values) if key.endswith(lower) else max(values))
            for key, values in runs.items()}
    fastest = min(range(len(runs["kvserve_decode_ms_per_token"])),
                  key=runs["kvserve_decode_ms_per_token"].__getitem__)
    best["bandwidth_gb_s"] = runs["bandwidth_gb_s"][fastest]
    return best


def summarize(r: dict[str, Any]) -> str:
    c = r["config"]
    lines = [
        f"model {c['model']} ({c['gguf'] or 'not a GGUF'}; kvserve {c['dtype']}"
        f"{' from its block codes' if c['weight_codes'] else ''}), {c['threads']} threads, "
        f"best of {c['repeats']} round{'s' * (c['repeats'] > 1)}",
        f"  cpu: {c['cpu']}; kvserve's kernels on {c['kvserve_isa']}",
        "  batch 1 (decode: ms/token, lower is better; prompt: tok/s of a "
        f"{c['prompt_len']}-token prompt)",
        f"    kvserve      decode {r['kvserve_decode_ms_per_token']:7.2f} ms   prompt "
        f"{r['kvserve_prompt_tok_s']:8.1f} tok/s",
    ]
    if c["llama_cpp"]:
        lines.append(
            f"    llama.cpp    decode {r['llama_cpp_decode_ms_per_token']:7.2f} ms   prompt "
            f"{r['llama_cpp_prompt_tok_s']:8.1f} tok/s   (llama-cpp-python "
            f"{c['llama_cpp']['version']})")
        lines.append(f"    kvserve/llama.cpp: decode speed {r['decode_speed_vs_llama_cpp']:.2f}x,"
                     f" prompt speed {r['prompt_speed_vs_llama_cpp']:.2f}x")
    else:
        lines.append(f"    llama.cpp    skipped: {c['llama_cpp_skipped']}")
    lines += [
        f"  physical bound at {r['bandwidth_gb_s']:.1f} GB/s (a sum() over a fresh 512 MB, "
        "around the decode):",
        f"    reading the block codes once   {r['weight_bytes_per_step'] / 1e6:6.0f} MB "
        f"{r['codes_read_ms']:6.2f} ms: kvserve's decode is {r['decode_vs_codes_read']:.2f}x",
        f"    reading fp32 weights once      {r['fp32_weight_bytes_per_step'] / 1e6:6.0f} MB "
        f"{r['fp32_read_ms']:6.2f} ms",
        f"    the model's own weights, a sum() each where they lie: {r['weights_read_ms']:.2f} ms"
        f" (decode {r['decode_vs_weights_read']:.2f}x)",
        f"  {c['requests']} requests x ({c['prompt_len']} + {c['output_len']}): output tok/s",
        f"    kvserve               {r['kvserve_tok_s']:8.1f}   "
        f"{r['throughput_vs_arithmetic_bound']:.0%} of the arithmetic bound",
        f"    arithmetic bound      {r['arithmetic_bound_tok_s']:8.1f}   (the projections' "
        f"{r['projection_tflop']:.2f} TFLOP at the fp32 GEMM's {r['fp32_gemm_gflop_s']:.0f} "
        "GFLOP/s)",
    ]
    if "hf_generate_batch_tok_s" in r:
        lines.append(f"    HF generate_batch()   {r['hf_generate_batch_tok_s']:8.1f}   kvserve "
                     f"{r['speedup_vs_hf_generate_batch']:.2f}x")
    if c["llama_cpp"]:
        lines.append(f"    llama.cpp, batch 1    {1000 / r['llama_cpp_decode_ms_per_token']:8.1f}"
                     f"   kvserve {r['throughput_vs_llama_cpp_batch1']:.2f}x")
    return "\n".join(lines)
