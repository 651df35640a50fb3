"""Checks of the flash_attn backend's kernels: on a CPU against the torch backend through the
references, on a GPU the real kernels against the same references (for the GPU check script).

Why here and not only in tests: the GPU check script runs on a machine lent for minutes, and
must report facts (which block sizes a kernel takes, whether `num_splits=1` rows are
batch-invariant, how far each kernel is from the reference) as JSON, not pass/fail. Every
function returns a JSON-able dict, `{"skipped": "no CUDA"}` where it needs a GPU and has none.
"""

from __future__ import annotations

import functools
import traceback
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvserve.workers.model_executor.attention import flash_reference as ref
from kvserve.workers.model_executor.attention import metadata as attention_metadata
from kvserve.workers.model_executor.attention.flash_backend import (
    FLASH_ATTN,
    PROVIDERS,
    TORCH_VARLEN,
    FlashAttention,
    FlashAttnProvider,
    KernelProvider,
    TorchVarlenProvider,
    make_provider,
    provider_missing,
)
from kvserve.workers.model_executor.attention.metadata import AttentionMetadata
from kvserve.workers.model_executor.attention.torch_backend import PagedAttention, TorchAttention

PROBE_BLOCK_SIZES = (16, 32, 64, 128, 256)


def reference_provider(
    name: str, *, dtypes: Sequence[torch.dtype] = ref.ALL_DTYPES, page_multiple: int = 1,
    batch_invariant: bool = True,
) -> KernelProvider:
    """Provider `name` (flash-attn / torch-varlen) with the pure-torch reference kernels in
    place of the real ones: the backend code is the real one, only the kernels differ. By
    default widened to fp32 and any page size, so that CPU tests cover fp32 and block 16; pass
    `ref.KERNEL_DTYPES` / `ref.PAGE_MULTIPLE` for the real kernels' limits."""
    limits = {"dtypes": tuple(dtypes), "page_multiple": page_multiple}
    if name == FLASH_ATTN:
        return FlashAttnProvider(
            functools.partial(ref.flash_attn_varlen_func, **limits),
            functools.partial(ref.flash_attn_with_kvcache, **limits),
            kernel_name="flash-attn reference", block_multiple=page_multiple,
            dtypes=tuple(dtypes), batch_invariant=batch_invariant)
    if name == TORCH_VARLEN:
        return TorchVarlenProvider(
            functools.partial(ref.varlen_attn, **limits), kernel_name="varlen_attn reference",
            block_multiple=page_multiple, dtypes=tuple(dtypes), batch_invariant=batch_invariant)
    raise ValueError(f"unknown flash provider {name!r}, expected one of {PROVIDERS}")


def use_backend(engine, backend: PagedAttention):
    """`engine` (an LLMEngine) with its attention backend swapped for `backend`: a backend its
    EngineConfig cannot name, such as FlashAttention over the reference kernels on a CPU, for
    tests and GPU checks. The engine's block size must suit the backend's kernels."""
    multiple = getattr(backend, "block_multiple", 1)
    if engine.info.block_size % multiple:
        raise ValueError(f"{backend.name} needs block_size a multiple of {multiple}, the engine "
                         f"has {engine.info.block_size}")
    engine.use_attention_backend(backend)
    return engine


# -- one step's inputs ----------------------------------------------------------------------


@dataclass
class Step:
    """One attention call's inputs, as the model runner makes them."""

    q: torch.Tensor  # [tokens, heads, head_dim], strided (a slice of a qkv row) like the model's
    k: torch.Tensor  # [tokens, kv_heads, head_dim]: this step's new keys
    v: torch.Tensor
    k_cache: torch.Tensor  # [blocks, block_size, kv_heads, head_dim]
    v_cache: torch.Tensor
    meta: AttentionMetadata
    scale: float

    def run(self, backend: PagedAttention, meta: AttentionMetadata | None = None,
            window: int = 0, softcap: float = 0.0) -> torch.Tensor:
        """backend(...) on copies of the caches (it writes this step's k/v into them)."""
        return backend(self.q, self.k, self.v, self.k_cache.clone(), self.v_cache.clone(),
                       meta or self.meta, self.scale, window, softcap)


def random_step(
    decode_lens: Sequence[int] = (), prefills: Sequence[tuple[int, int]] = (), *,
    heads: int = 4, kv_heads: int = 2, head_dim: int = 16, block_size: int = 16,
    dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu", seed: int = 0,
) -> Step:
    """A batch of decodes (context lengths) then prefill chunks ((q_len, context_len): a chunk
    over a cached prefix when context_len > q_len). Every sequence's blocks are scattered over
    a pool with spare blocks, all of it random: reading a wrong block or slot changes results."""
    device = torch.device(device)
    gen = torch.Generator().manual_seed(seed)
    lengths = [*decode_lens, *(ctx for _, ctx in prefills)]
    blocks = [-(-n // block_size) for n in lengths]
    num_blocks = sum(blocks) + 3
    pool = torch.randperm(num_blocks, generator=gen).tolist()
    tables = [[pool.pop() for _ in range(n)] for n in blocks]
    shape = (num_blocks, block_size, kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen).to(device, dtype)
    v_cache = torch.randn(shape, generator=gen).to(device, dtype)
    positions = [[n - 1] for n in decode_lens]  # new tokens' positions, per sequence
    positions += [list(range(ctx - q_len, ctx)) for q_len, ctx in prefills]
    slots = [table[p // block_size] * block_size + p % block_size
             for table, pos in zip(tables, positions, strict=True) for p in pos]
    tokens = len(slots)
    qkv = torch.randn(tokens, heads + 2 * kv_heads, head_dim, generator=gen).to(device, dtype)
    q = qkv[:, :heads]  # [tokens, heads, head_dim], rows strided as the model's
    k = qkv[:, heads:heads + kv_heads]
    v = qkv[:, heads + kv_heads:]
    nd = len(decode_lens)
    meta, _ = attention_metadata.build(
        device, slots, decodes=list(zip(tables[:nd], decode_lens, strict=True)),
        prefills=[(t, q_len, ctx) for t, (q_len, ctx) in zip(tables[nd:], prefills, strict=True)],
        block_size=block_size)
    return Step(q, k, v, k_cache, v_cache, meta, head_dim**-0.5)


# cases the GPU check runs (and CPU tests mirror at block 16): name -> (decodes, prefills)
CASES: dict[str, tuple[tuple[int, ...], tuple[tuple[int, int], ...]]] = {
    "decodes": ((1, 17, 300, 600), ()),
    "prefills_fresh": ((), ((64, 64), (7, 7), (300, 300))),
    "prefills_over_cached_prefix": ((), ((50, 350), (7, 263), (256, 512))),
    "mixed": ((5, 260, 513), ((33, 33), (100, 612), (1, 40), (256, 512))),
}
HEAD_SHAPES = ((9, 3, 64), (4, 4, 64), (14, 2, 64))  # SmolLM2, no GQA, Qwen2-0.5B's 7:1


# -- GPU checks -----------------------------------------------------------------------------


def compare_with_reference(
    provider: str, dtype: torch.dtype = torch.bfloat16, device: str = "cuda",
    block_size: int = 256,
) -> dict:
    """Max abs error of the real kernels (through the backend) against the reference, and of
    both against the torch backend, per case and head shape, on the same inputs."""
    skipped = _skipped(provider, device)
    if skipped:
        return skipped
    real, reference = _real_and_reference(provider)
    out: dict = {"kernel": real.kernel_name, "dtype": str(dtype), "block_size": block_size,
                 "cases": {}}
    for name, (decodes, prefills) in CASES.items():
        for heads, kv_heads, head_dim in HEAD_SHAPES:
            key = f"{name}/{heads}q{kv_heads}kv"
            step = random_step(decodes, prefills, heads=heads, kv_heads=kv_heads,
                               head_dim=head_dim, block_size=block_size, dtype=dtype,
                               device=device, seed=len(out["cases"]))
            out["cases"][key] = _errors(step, real, reference)
    errs = [c["vs_reference"] for c in out["cases"].values() if "vs_reference" in c]
    out["max_vs_reference"] = max(errs, default=None)
    return out


def probe_block_sizes(
    provider: str, sizes: Sequence[int] = PROBE_BLOCK_SIZES, dtype: torch.dtype = torch.bfloat16,
    device: str = "cuda",
) -> dict:
    """Per block size: does the real kernel run a mixed step (decodes + a chunk over a cached
    prefix), and how far from the reference; or the error it raised."""
    skipped = _skipped(provider, device)
    if skipped:
        return skipped
    real, reference = _real_and_reference(provider)
    result: dict = {"kernel": real.kernel_name}
    for size in sizes:
        step = random_step((3, 2 * size + 5), ((9, 9), (20, 3 * size + 1)), heads=9,
                           kv_heads=3, head_dim=64, block_size=size, dtype=dtype,
                           device=device)
        result[str(size)] = _errors(step, real, reference)
    result["accepted"] = [s for s in sizes if result[str(s)].get("ok")]
    return result


def probe_batch_invariance(
    provider: str, dtype: torch.dtype = torch.bfloat16, device: str = "cuda",
    block_size: int = 256,
) -> dict:
    """Is a row bit-identical alone and in a batch of different-length neighbours? For decodes
    with num_splits=1 (what the backend runs) and with the kernel's own split choice, and for a
    prefill chunk (the kernel's split choice)."""
    skipped = _skipped(provider, device)
    if skipped:
        return skipped
    result: dict = {}
    target, neighbours = 3000, (7, 9000, 130, 5000, 2, 700, 12000)
    chunk, neighbour_chunks = (64, 3000), ((5, 5), (400, 9000), (256, 2000))
    for label, invariant in (("decode_num_splits_1", True), ("decode_num_splits_auto", False)):
        provider_obj = (FlashAttnProvider(batch_invariant=invariant) if provider == FLASH_ATTN
                        else TorchVarlenProvider(batch_invariant=invariant))
        backend = FlashAttention(provider_obj)
        try:
            alone = _row_alone_and_batched(backend, (target,), (), (target, *neighbours), (),
                                           dtype, device, block_size, rows=slice(0, 1))
            result[label] = alone
        except Exception as exc:  # a report, not a test: say what failed
            result[label] = {"error": _error(exc)}
    backend = FlashAttention(make_provider(provider))
    try:
        result["prefill_auto_splits"] = _row_alone_and_batched(
            backend, (), (chunk,), (), (chunk, *neighbour_chunks), dtype, device, block_size,
            rows=slice(0, chunk[0]))
    except Exception as exc:
        result["prefill_auto_splits"] = {"error": _error(exc)}
    return result


def run_all(device: str = "cuda") -> dict:
    """Everything above for every provider available here, in bf16 and fp16."""
    if not _cuda(device):
        return {"skipped": "no CUDA"}
    report: dict = {"torch": torch.__version__,
                    "device": torch.cuda.get_device_name(torch.device(device)),
                    "providers": {p: provider_missing(p) or "available" for p in PROVIDERS}}
    for p in PROVIDERS:
        if provider_missing(p):
            continue
        report[p] = {
            "block_sizes": _guarded(probe_block_sizes, p, device=device),
            "batch_invariance": _guarded(probe_batch_invariance, p, device=device),
            "bf16": _guarded(compare_with_reference, p, torch.bfloat16, device),
            "fp16": _guarded(compare_with_reference, p, torch.float16, device),
        }
    return report


def _errors(step: Step, real: PagedAttention, reference: PagedAttention) -> dict:
    """Max abs errors: real vs reference, real vs torch backend, reference vs torch backend."""
    try:
        got = step.run(real).float()
        if got.is_cuda:
            torch.cuda.synchronize()  # a kernel's asynchronous error surfaces here
    except Exception as exc:
        return {"ok": False, "error": _error(exc)}
    expected = step.run(reference).float()
    torch_out = step.run(TorchAttention()).float()
    return {"ok": bool(torch.isfinite(got).all()),
            "vs_reference": (got - expected).abs().max().item(),
            "vs_torch": (got - torch_out).abs().max().item(),
            "reference_vs_torch": (expected - torch_out).abs().max().item()}


def _row_alone_and_batched(
    backend: PagedAttention, decodes_alone: Sequence[int], prefills_alone,
    decodes_batched: Sequence[int], prefills_batched, dtype: torch.dtype, device: str,
    block_size: int, rows: slice,
) -> dict:
    """The same sequence's rows, computed alone and in a batch: its q and its cache contents
    are copied into the batched step so only the neighbours differ."""
    alone = random_step(decodes_alone, prefills_alone, heads=9, kv_heads=3, head_dim=64,
                        block_size=block_size, dtype=dtype, device=device, seed=1)
    batched = random_step(decodes_batched, prefills_batched, heads=9, kv_heads=3, head_dim=64,
                          block_size=block_size, dtype=dtype, device=device, seed=2)
    _transplant(alone, batched, rows)
    a = alone.run(backend)[rows]
    b = batched.run(backend)[rows]
    return {"bit_identical": bool(torch.equal(a, b)),
            "max_abs_diff": (a.float() - b.float()).abs().max().item()}


def _transplant(src: Step, dst: Step, rows: slice) -> None:
    """dst's first sequence gets src's first sequence: its query/new k/v rows and its blocks."""
    dst.q[rows] = src.q[rows]
    dst.k[rows] = src.k[rows]
    dst.v[rows] = src.v[rows]
    if src.meta.num_decodes:
        src_table, dst_table = src.meta.decode_block_tables[0], dst.meta.decode_block_tables[0]
    else:
        src_table, dst_table = src.meta.prefill_block_tables[0], dst.meta.prefill_block_tables[0]
    n = min(len(src_table), len(dst_table))
    dst.k_cache[dst_table[:n].long()] = src.k_cache[src_table[:n].long()]
    dst.v_cache[dst_table[:n].long()] = src.v_cache[src_table[:n].long()]


def _skipped(provider: str, device: str) -> dict | None:
    """Why a GPU check of `provider` cannot run here, as its JSON result; None when it can."""
    if not _cuda(device):
        return {"skipped": "no CUDA"}
    missing = provider_missing(provider)
    return {"skipped": missing} if missing else None


def _real_and_reference(provider: str) -> tuple[FlashAttention, FlashAttention]:
    """The backend over `provider`'s real kernels, and over its references (any page size)."""
    return (FlashAttention(make_provider(provider)),
            FlashAttention(reference_provider(provider, page_multiple=1)))


def _guarded(fn, *args, **kwargs) -> dict:
    try:
        return fn(*args, **kwargs)
    except Exception as exc:
        return {"error": _error(exc)}


def _error(exc: BaseException) -> str:
    lines = traceback.format_exception_only(type(exc), exc)
    return "".join(lines).strip()[:500]


def _cuda(device: str) -> bool:
    return torch.device(device).type == "cuda" and torch.cuda.is_available()
