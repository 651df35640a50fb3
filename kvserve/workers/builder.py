"""Building an engine's parts from an EngineConfig: device, dtype, model, KV pool, runner, block
manager, scheduler and proposer, each sized and checked once.

Why a module of its own: every choice here is made once at start (which attention backend, how
many KV blocks fit, whether decode replays CUDA graphs) and a wrong setting must stop the engine
before it takes a request, not inside its first step. The step loop (`engine.py`) never sees any
of it: it receives the built parts (`EngineParts`).
"""

from __future__ import annotations

import json
import logging
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from kvserve.workers.config import DTYPES, EngineConfig
from kvserve.workers.core.block_manager import BlockManager
from kvserve.workers.core.host_block_pool import HostBlockPool
from kvserve.workers.core.kv_events import KVEvents
from kvserve.workers.core.ngram_proposer import NgramProposer
from kvserve.workers.core.scheduler import Scheduler
from kvserve.workers.core.sequence import Sequence
from kvserve.workers.model_executor.attention import (
    PagedAttention,
    make_backend,
    resolve_backend_name,
)
from kvserve.workers.model_executor.cpu_kernels import (
    CpuKernels,
    fallback_note,
    kernels_isa,
    load_cpu_kernels,
)
from kvserve.workers.model_executor.cuda_graphs import graph_batch_sizes, graph_memory_bytes
from kvserve.workers.model_executor.draft_proposer import DraftModelProposer
from kvserve.workers.model_executor.families import kv_window
from kvserve.workers.model_executor.kv_cache import KVCacheSpec
from kvserve.workers.model_executor.loader import (
    DEFAULT_MODEL,
    LoadedCheckpoint,
    load_checkpoint,
    with_rope_override,
)
from kvserve.workers.model_executor.model import CausalLM, onednn_available
from kvserve.workers.model_executor.model_runner import ModelRunner, StepSender
from kvserve.workers.model_executor.rope import RotaryEmbedding
from kvserve.workers.parallel.group import TPGroup
from kvserve.workers.parallel.ranks import Followers, RankLauncher, start_followers
from kvserve.workers.parallel.shard import check_divisible, head_dim

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ModelInfo:
    """What this engine serves and how (the ModelInfo RPC, benchmark reports)."""

    name: str
    vocab_size: int
    max_model_len: int
    rope_parameters: dict[str, Any]
    dtype: str
    device: str
    attention_backend: str
    block_size: int
    num_blocks: int
    num_host_blocks: int
    cuda_graph_sizes: tuple[int, ...] = ()  # decode batch sizes replayed from CUDA graphs
    tensor_parallel_size: int = 1  # ranks the model is split over (`kvserve.workers.parallel`)
    cpu_isa: str = ""  # CPUs: what kvserve's kernels' projections run on (avx512, avx2, none)


class Proposer(Protocol):
    """Where speculative drafts come from (`NgramProposer`, `DraftModelProposer`)."""

    def propose(self, requests: list[tuple[Sequence, int]]) -> list[list[int]]:
        """Up to k draft tokens to follow each (decoding sequence, k)."""
        ...

    def forget(self, request_id: str) -> None:
        """The request ended: drop whatever is kept for it."""
        ...


@dataclass
class EngineParts:
    """Everything an LLMEngine steps with, built and checked."""

    checkpoint: LoadedCheckpoint
    device: torch.device
    dtype: torch.dtype
    max_model_len: int
    runner: ModelRunner  # its model: runner.model
    block_manager: BlockManager
    scheduler: Scheduler
    kv_events: KVEvents
    proposer: Proposer | None
    eos_token_ids: set[int]
    bytes_per_block: int
    info: ModelInfo
    cpu_kernels: CpuKernels | None  # kvserve's C++ kernels (fp32 and bf16 on a CPU), else None
    followers: Followers | None = None  # tensor_parallel_size > 1: the other ranks


def build_engine_parts(config: EngineConfig, checkpoint: LoadedCheckpoint | None = None,
                       draft_checkpoint: LoadedCheckpoint | None = None,
                       rank_launcher: RankLauncher | None = None) -> EngineParts:
    """The parts for `config`; `checkpoint` replaces loading `config.model`, and
    `draft_checkpoint` loading `config.draft_model`; `rank_launcher` starts the tensor-parallel
    ranks 1..N-1 (local processes by default; a Serve replica's are Ray actors)."""
    device = resolve_device(config.device)
    if config.num_threads:
        torch.set_num_threads(config.num_threads)
    elif config.tensor_parallel_size > 1 and device.type == "cpu":  # the cores shared by rank
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // config.tensor_parallel_size))
    dtype = resolve_dtype(config.dtype, device)
    # on a new machine the kernel build (a compiler in subprocesses) and the model's first
    # conversion (Python, mostly one core) take ~20 s each: side by side, not one after the
    # other (on 2 cores they only share the cores; hosts with more cores overlap them)
    pool = ThreadPoolExecutor(1, thread_name_prefix="kvserve-kernels")
    kernels = pool.submit(cpu_kernels_for, device, dtype)
    try:
        ckpt = with_rope_override(checkpoint or load_checkpoint(config.model),
                                  config.rope_parameters)
    finally:
        pool.shutdown(wait=False)  # a missing model is reported without waiting for a build
    cpu_kernels = kernels.result()
    followers = None
    if config.tensor_parallel_size > 1:  # ranks 1..N-1 start loading while rank 0 does
        check_divisible(ckpt.config, config.tensor_parallel_size, config.model or DEFAULT_MODEL)
        followers = start_followers(config, ckpt, device, rank_launcher)
    try:
        rank = build_rank(config, ckpt, device, dtype, cpu_kernels,
                          followers.group if followers else None, followers)
    except BaseException:
        if followers is not None:
            followers.close()
        raise
    runner, spec, num_blocks, num_host_blocks = (rank.runner, rank.spec, rank.num_blocks,
                                                 rank.num_host_blocks)
    max_model_len, block_size, backend = rank.max_model_len, spec.block_size, runner.backend
    model = runner.model
    kv_events = KVEvents()  # the cluster turns it on to report to its cache manager
    host = HostBlockPool(num_host_blocks, kv_events) if num_host_blocks else None
    block_manager = BlockManager(num_blocks, block_size,
                                 enable_caching=config.enable_prefix_caching, host=host,
                                 events=kv_events, sliding_window=kv_window(ckpt.config),
                                 max_step_tokens=config.max_num_batched_tokens)
    eos = eos_ids(ckpt)
    scheduler = Scheduler(block_manager, config.max_num_seqs, config.max_num_batched_tokens,
                          max_model_len, eos)
    info = ModelInfo(
        name=config.model or DEFAULT_MODEL, vocab_size=ckpt.config.vocab_size,
        max_model_len=max_model_len, rope_parameters=dict(ckpt.config.rope_parameters),
        dtype=str(dtype).removeprefix("torch."), device=str(device),
        attention_backend=backend.name, block_size=block_size, num_blocks=num_blocks,
        num_host_blocks=num_host_blocks,
        cuda_graph_sizes=tuple(runner.graphs.sizes) if runner.graphs else (),
        tensor_parallel_size=config.tensor_parallel_size,
        cpu_isa=kernels_isa(cpu_kernels) if device.type == "cpu" else "")
    proposer = make_proposer(config, ckpt, draft_checkpoint, model, runner, cpu_kernels, spec,
                             num_blocks, max_model_len)
    return EngineParts(ckpt, device, dtype, max_model_len, runner, block_manager,
                       scheduler, kv_events, proposer, eos, spec.bytes_per_block, info,
                       cpu_kernels, followers)


@dataclass
class RankParts:
    """What each rank of an engine steps with: rank 0's model runner, or a tp group's other
    ranks' (the same model over another slice, the same number of blocks)."""

    runner: ModelRunner
    spec: KVCacheSpec  # this rank's: its KV heads
    num_blocks: int
    num_host_blocks: int
    max_model_len: int


def build_rank(config: EngineConfig, ckpt: LoadedCheckpoint, device: torch.device,
               dtype: torch.dtype, cpu_kernels: CpuKernels | None, tp: TPGroup | None = None,
               followers: StepSender | None = None) -> RankParts:
    """The model, KV pool and runner of one rank (`tp`: its group; every rank runs this, in
    step, since the pool's size is agreed by a collective). `followers`: rank 0's link to the
    others."""
    max_model_len = model_len(config, ckpt.config)
    backend_name = resolve_backend_name(config.attention_backend, device)
    model = build_model(ckpt, device, dtype, cpu_kernels, triton=backend_name == "triton",
                        weight_codes=config.weight_codes, tp=tp)
    # the decode attention kernel runs fp32 and bf16: other dtypes take the torch backend
    attention_kernels = cpu_kernels if dtype in (torch.float32, torch.bfloat16) else None
    backend = make_backend(backend_name, attention_kernels)
    block_size = resolve_block_size(config.block_size, backend, dtype)
    spec = kv_spec(ckpt.config, block_size, dtype, tp.size if tp else 1)
    graphs = uses_graphs(config, device, backend)
    graph_bytes = graph_bytes_for(config, ckpt.config, spec, max_model_len) if graphs else 0
    num_blocks = config.num_kv_blocks or spec.num_blocks_for(kv_budget(config, device, graph_bytes))
    num_host_blocks = config.num_host_kv_blocks
    if num_host_blocks is None:
        num_host_blocks = spec.num_blocks_for(config.cpu_offload_memory)
    if tp is not None:  # block ids mean the same on every rank: as many as the fewest hold
        num_blocks, num_host_blocks = tp.min_int(num_blocks), tp.min_int(num_host_blocks)
    if num_blocks < 1:
        raise ValueError("kv_cache_memory is smaller than one KV block")
    rope = RotaryEmbedding(ckpt.config, max_model_len, device, dtype)
    runner = ModelRunner(model, spec, num_blocks, rope, backend, device, num_host_blocks,
                         followers)
    if graphs:  # captured before any request: at a replica's start, before it is ready
        runner.enable_decode_graphs(graph_batch_sizes(config.max_num_seqs), max_model_len,
                                    capture=True)
    return RankParts(runner, spec, num_blocks, num_host_blocks, max_model_len)


def make_proposer(config: EngineConfig, target: LoadedCheckpoint,
                  draft: LoadedCheckpoint | None, target_model: CausalLM, runner: ModelRunner,
                  cpu_kernels: CpuKernels | None, target_spec: KVCacheSpec, num_blocks: int,
                  max_model_len: int) -> Proposer | None:
    """The speculative_method's proposer. A draft model gets its own runner and KV pool
    (as many blocks as the target's), on the target's device and attention backend; the
    target as its own draft shares its weights."""
    if config.speculative_method == "ngram":
        return NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
    if config.speculative_method != "draft_model":
        return None
    if draft is None and config.draft_model is not None:
        draft = load_checkpoint(config.draft_model)
    vocab_size = target.config.vocab_size
    if draft is not None and draft.config.vocab_size != vocab_size:
        raise ValueError(f"draft_model: its vocabulary has {draft.config.vocab_size} tokens, "
                         f"the target's {vocab_size}; they must share a tokenizer")
    draft = draft or target
    device, dtype, block_size = runner.device, target_spec.dtype, target_spec.block_size
    # under tp the draft runs whole on rank 0 (the target's weights are split)
    model = target_model if draft is target and target_model.tp is None else build_model(
        draft, device, dtype, cpu_kernels, weight_codes=config.weight_codes)
    spec = kv_spec(draft.config, block_size, dtype)
    rope = RotaryEmbedding(draft.config, max_model_len, device, dtype)
    draft_runner = ModelRunner(model, spec, num_blocks, rope, runner.backend, runner.device)
    return DraftModelProposer(draft_runner, BlockManager(num_blocks, block_size))


def model_len(config: EngineConfig, hf_config) -> int:
    """The context length: max_model_len, else the model's."""
    return config.max_model_len or hf_config.max_position_embeddings


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """`auto`: bf16 on CUDA, fp32 on a CPU (bf16 on a CPU runs kvserve's kernels at about
    fp32's speed, or, where they cannot run, says so at the start: `cpu_kernels_for`)."""
    if name not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, not {name!r}")
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, name)


def resolve_block_size(block_size: int | None, backend: PagedAttention,
                       dtype: torch.dtype) -> int:
    """What the backend's kernels accept: flash_attn's paged cache needs a multiple of its
    provider's page size (256), and bf16/fp16. Checked here, so a wrong setting stops the
    engine (and a replica's start) instead of its first request."""
    multiple = getattr(backend, "block_multiple", 1)
    dtypes = getattr(getattr(backend, "provider", None), "dtypes", None)
    if dtypes is not None and dtype not in dtypes:
        names = ", ".join(str(d).removeprefix("torch.") for d in dtypes)
        raise ValueError(f"attention_backend {backend.name} ({backend.kernel_name}) runs "
                         f"{names}, not dtype {str(dtype).removeprefix('torch.')}")
    block_size = block_size or (multiple if multiple > 1 else 16)
    if block_size % multiple:
        raise ValueError(f"attention_backend {backend.name} ({backend.kernel_name}) needs "
                         f"block_size a multiple of {multiple}, not {block_size}")
    return block_size


def cpu_kernels_for(device: torch.device, dtype: torch.dtype) -> CpuKernels | None:
    """kvserve's C++ kernels where they apply (fp32 and bf16 on a CPU), built at first use.
    fp16 runs torch's ops and oneDNN: CPUs have no fp16 arithmetic worth a kernel of its own."""
    if device.type != "cpu" or dtype not in (torch.float32, torch.bfloat16):
        return None
    kernels = load_cpu_kernels()
    if note := fallback_note(kernels, dtype):  # once, at the engine's start
        log.warning(note)
    return kernels


def build_model(
    ckpt: LoadedCheckpoint, device: torch.device, dtype: torch.dtype,
    cpu_kernels: CpuKernels | None, triton: bool = False, weight_codes: bool = True,
    tp: TPGroup | None = None,
) -> CausalLM:
    """The model in `dtype` on `device`; `triton`: with its Triton kernels (the triton
    attention backend's model, `CausalLM.use_triton_kernels`); `weight_codes`: fp32 projections
    read block codes where they give back the weights exactly (`Linear.pack_for_kernels`);
    `tp`: this rank's slice of it (`kvserve.workers.parallel.shard`)."""
    key = (device, dtype, cpu_kernels is not None, triton, weight_codes)
    if tp is None and key in ckpt.models:  # another engine in this process built it
        return ckpt.models[key]
    with torch.device("meta"):
        model = CausalLM(ckpt.config, tp)
    model = materialize(model, device, dtype)
    if ckpt.config.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    model.load_checkpoint(dict(ckpt.tensors))
    if triton:
        model.use_triton_kernels()
    elif cpu_kernels is not None:
        model.use_cpu_kernels(cpu_kernels, weight_codes)
    if device.type == "cpu" and onednn_available(dtype):
        model.use_onednn_matmuls()
    model = model.eval()
    if tp is None:  # a rank's model holds its group: it is that engine's alone
        ckpt.models[key] = model
    return model


def materialize(model: torch.nn.Module, device: torch.device,
                dtype: torch.dtype) -> torch.nn.Module:
    """`model`, built on the meta device, with each parameter uninitialised memory on `device`
    (floating point ones in `dtype`): the checkpoint fills them next. What
    `model.to_empty(device=device).to(dtype)` gives, without its cost: `to_empty` allocates by
    `torch.empty_like`, whose meta-tensor path imports sympy (~0.4 CPU-s of every replica's
    start), and `.to(dtype)` allocated a second copy in another dtype."""
    for module in model.modules():
        for name, param in list(module.named_parameters(recurse=False)):
            kind = dtype if param.is_floating_point() else param.dtype
            empty = torch.empty(param.shape, dtype=kind, device=device)
            setattr(module, name, torch.nn.Parameter(empty, requires_grad=param.requires_grad))
    return model


def kv_spec(config, block_size: int, dtype: torch.dtype, tp_size: int = 1) -> KVCacheSpec:
    """The KV pool's block shape; under tp each rank holds its KV heads of every block."""
    return KVCacheSpec(config.num_hidden_layers, config.num_key_value_heads // tp_size,
                       head_dim(config), block_size, dtype)


def kv_budget(config: EngineConfig, device: torch.device, graph_bytes: int = 0) -> int:
    """The KV pool's bytes: kv_cache_memory as given, else (CUDA) the device's share less what
    is in use, an activation reserve and what the decode graphs will take (`graph_bytes`)."""
    if config.kv_cache_memory is not None:
        return config.kv_cache_memory
    if device.type != "cuda":
        return config.cpu_kv_cache_memory
    free, total = torch.cuda.mem_get_info(device)
    used = total - free
    # leave room for activations of a full step: a quarter of what the weights take, at least 1 GiB
    reserve = max(1024**3, torch.cuda.memory_allocated(device) // 4)
    return max(0, int(total * config.gpu_memory_utilization) - used - reserve - graph_bytes)


def uses_graphs(config: EngineConfig, device: torch.device, backend: PagedAttention) -> bool:
    """Decode steps replay CUDA graphs: on CUDA, unless enforce_eager, with a backend whose
    launches depend on the batch size alone (triton)."""
    return (device.type == "cuda" and not config.enforce_eager
            and getattr(backend, "supports_cuda_graphs", False))


def graph_bytes_for(config: EngineConfig, hf_config, spec: KVCacheSpec,
                    max_model_len: int) -> int:
    """`cuda_graphs.graph_memory_bytes` for this model at max_num_seqs rows."""
    return graph_memory_bytes(
        config.max_num_seqs, -(-max_model_len // spec.block_size), hf_config.hidden_size,
        hf_config.num_attention_heads, spec.num_kv_heads, spec.head_dim,
        hf_config.intermediate_size, spec.dtype)


def eos_ids(ckpt: LoadedCheckpoint) -> set[int]:
    """The model's end-of-sequence tokens: its generation config's and its tokenizer's."""
    ids: set[int] = set()
    gen_path = ckpt.path / "generation_config.json"
    if gen_path.exists():
        eos = json.loads(gen_path.read_text()).get("eos_token_id")
        ids |= set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    if ckpt.tokenizer.eos_token_id is not None:
        ids.add(ckpt.tokenizer.eos_token_id)
    return ids
