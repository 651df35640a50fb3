"""FlashAttention-2 over the paged cache (CUDA), from one of two kernel providers.

- `flash-attn` (the optional `gpu` extra): prefill chunks through
  `flash_attn_varlen_func(..., block_table=...)`, decodes through
  `flash_attn_with_kvcache(..., cache_seqlens=..., block_table=...)`.
- `torch-varlen`: torch>=2.13's `torch.nn.attention.varlen.varlen_attn(..., seqused_k=...,
  block_table=...)`, aten's own copy of the FlashAttention-2 kernels, so a stock CUDA torch
  serves without building flash-attn.

Why a provider object: the backend's job is translating a step's `AttentionMetadata` into
kernel arguments; the provider holds the kernel functions, injected, so that CI can run this
exact translation against pure-torch references of the kernels
(`kvserve.workers.model_executor.attention.flash_reference`) on a CPU.

Both providers need the cache's block size to be a multiple of 256: FlashAttention-2's
mha_varlen_fwd and mha_fwd_kvcache check `page_block_size % 256 == 0` for a paged cache (in
flash-attn and in aten's flash_api.cpp alike), and accept only fp16/bf16 (sm80+).
`flash_checks.probe_block_sizes` measures this on a GPU.

Decodes run with `num_splits=1`: split-KV picks its split count from the batch (max_k, batch
size), so without it one sequence's logits would depend on what else is in the batch.
"""

from __future__ import annotations

import importlib.util
import inspect
from collections.abc import Callable
from typing import Protocol

import torch

from kvserve.workers.model_executor.attention.metadata import AttentionMetadata
from kvserve.workers.model_executor.attention.torch_backend import PagedAttention

FLASH_ATTN = "flash-attn"
TORCH_VARLEN = "torch-varlen"
PROVIDERS = (FLASH_ATTN, TORCH_VARLEN)  # in order of preference
# block_size must be a multiple of this, per provider (see the module docstring)
BLOCK_MULTIPLES = {FLASH_ATTN: 256, TORCH_VARLEN: 256}
FLASH_BLOCK_MULTIPLE = max(BLOCK_MULTIPLES.values())  # a block size every provider accepts
KERNEL_DTYPES = (torch.float16, torch.bfloat16)
_VARLEN_ARGS = ("seqused_k", "block_table", "num_splits")


class KernelProvider(Protocol):
    """Kernel calls for one step's decodes and prefill chunks, over the paged cache."""

    name: str  # one of PROVIDERS
    kernel_name: str  # what ran, for reports: e.g. "flash-attn 2.8.3"
    softcap: bool  # takes a soft-cap of the scores (Gemma 2)
    block_multiple: int
    dtypes: tuple[torch.dtype, ...]

    def decode(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               meta: AttentionMetadata, scale: float, window: int = 0,
               softcap: float = 0.0) -> torch.Tensor: ...

    def prefill(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                meta: AttentionMetadata, scale: float, window: int = 0,
                softcap: float = 0.0) -> torch.Tensor: ...


def left_window(window: int) -> int:
    """FlashAttention's `window_size[0]` for a sliding window of `window` keys (the query's own
    key and window - 1 before it); -1, unbounded, for full attention."""
    return window - 1 if window else -1


class FlashAttnProvider:
    """The flash-attn package's kernels (or functions with their signatures: tests inject the
    references). `batch_invariant=False` lets the kernel choose decode splits (probes only)."""

    name = FLASH_ATTN
    softcap = True

    def __init__(
        self, varlen_func: Callable | None = None, with_kvcache: Callable | None = None, *,
        kernel_name: str | None = None, block_multiple: int = BLOCK_MULTIPLES[FLASH_ATTN],
        dtypes: tuple[torch.dtype, ...] = KERNEL_DTYPES, batch_invariant: bool = True,
    ) -> None:
        if varlen_func is None or with_kvcache is None:
            import flash_attn  # lazy: loads CUDA libraries

            varlen_func = varlen_func or flash_attn.flash_attn_varlen_func
            with_kvcache = with_kvcache or flash_attn.flash_attn_with_kvcache
            kernel_name = kernel_name or f"flash-attn {flash_attn.__version__}"
        self._varlen = varlen_func
        self._with_kvcache = with_kvcache
        self.kernel_name = kernel_name or FLASH_ATTN
        self.block_multiple = block_multiple
        self.dtypes = dtypes
        self._decode_splits = 1 if batch_invariant else 0  # 0: the kernel's heuristic

    def decode(self, q, k_cache, v_cache, meta: AttentionMetadata, scale: float,
               window: int = 0, softcap: float = 0.0) -> torch.Tensor:
        # q: [decodes, heads, head_dim] -> [decodes, 1, heads, head_dim]: one query per sequence
        out = self._with_kvcache(
            q.unsqueeze(1), k_cache, v_cache,
            cache_seqlens=meta.decode_context_lens, block_table=meta.decode_block_tables,
            softmax_scale=scale, causal=True, window_size=(left_window(window), 0),
            softcap=softcap, num_splits=self._decode_splits,
        )  # [decodes, 1, heads, head_dim]
        return out.squeeze(1)

    def prefill(self, q, k_cache, v_cache, meta: AttentionMetadata, scale: float,
                window: int = 0, softcap: float = 0.0) -> torch.Tensor:
        # q: [prefill tokens, heads, head_dim]. The chunks' k/v are already in the cache, so
        # every chunk reads its whole context (cached prefix + itself) through its block table;
        # cu_seqlens_k then only says how many keys each chunk has, causal aligns bottom-right
        return self._varlen(
            q, k_cache, v_cache,
            cu_seqlens_q=meta.cu_seqlens_q, cu_seqlens_k=meta.cu_seqlens_k,
            max_seqlen_q=meta.max_prefill_q, max_seqlen_k=meta.max_prefill_k,
            softmax_scale=scale, causal=True, window_size=(left_window(window), 0),
            softcap=softcap, block_table=meta.prefill_block_tables,
        )


class TorchVarlenProvider:
    """torch's `varlen_attn` (or a function with its signature: tests inject the reference).
    `batch_invariant=False` lets the kernel choose decode splits (probes only)."""

    name = TORCH_VARLEN
    softcap = False  # varlen_attn has no softcap argument

    def __init__(
        self, varlen_attn: Callable | None = None, *, kernel_name: str | None = None,
        block_multiple: int = BLOCK_MULTIPLES[TORCH_VARLEN],
        dtypes: tuple[torch.dtype, ...] = KERNEL_DTYPES, batch_invariant: bool = True,
    ) -> None:
        if varlen_attn is None:
            from torch.nn.attention.varlen import varlen_attn

            kernel_name = kernel_name or f"torch {torch.__version__} varlen_attn"
        self._varlen = varlen_attn
        self.kernel_name = kernel_name or TORCH_VARLEN
        self.block_multiple = block_multiple
        self.dtypes = dtypes
        self._decode_splits = 1 if batch_invariant else None  # None: the kernel's heuristic
        # the step's derived tensors, made at the first layer and reused by the others
        self._step: tuple[AttentionMetadata | None, dict[str, torch.Tensor]] = (None, {})

    def decode(self, q, k_cache, v_cache, meta: AttentionMetadata, scale: float,
               window: int = 0, softcap: float = 0.0) -> torch.Tensor:
        # q: [decodes, heads, head_dim], each a sequence of one query. A single query row sees
        # every key of its sequence whether causal or not; non-causal (-1, -1) lets the kernel
        # fold the GQA group into the query rows (mha_varlen_fwd's seqlenq_ngroups_swapped).
        # A sliding window is causal: (window - 1, 0), bottom-right aligned
        step = self._derived(meta)
        return self._varlen(
            q, k_cache, v_cache, step["decode_cu_q"], step["decode_cu_k"],
            1, meta.max_decode_context,
            scale=scale, window_size=(window - 1, 0) if window else (-1, -1), enable_gqa=True,
            seqused_k=meta.decode_context_lens, block_table=meta.decode_block_tables,
            num_splits=self._decode_splits,
        )

    def prefill(self, q, k_cache, v_cache, meta: AttentionMetadata, scale: float,
                window: int = 0, softcap: float = 0.0) -> torch.Tensor:
        # q: [prefill tokens, heads, head_dim]; k/v of the chunks are in the cache already
        step = self._derived(meta)
        return self._varlen(
            q, k_cache, v_cache, meta.cu_seqlens_q, meta.cu_seqlens_k,
            meta.max_prefill_q, meta.max_prefill_k,
            scale=scale, window_size=(left_window(window), 0), enable_gqa=True,
            seqused_k=step["prefill_seqused_k"], block_table=meta.prefill_block_tables,
        )

    def _derived(self, meta: AttentionMetadata) -> dict[str, torch.Tensor]:
        """varlen_attn's extra int32 tensors, on the device, once per step (not per layer):
        decodes' cu_seq_q/cu_seq_k and prefill chunks' seqused_k (what block_table requires)."""
        if self._step[0] is meta:
            return self._step[1]
        step: dict[str, torch.Tensor] = {}
        if meta.num_decodes:
            lens = meta.decode_context_lens  # [decodes] int32
            step["decode_cu_q"] = torch.arange(meta.num_decodes + 1, dtype=torch.int32,
                                               device=lens.device)
            step["decode_cu_k"] = torch.cat(
                (lens.new_zeros(1), torch.cumsum(lens, 0, dtype=torch.int32)))
        if meta.prefills:
            step["prefill_seqused_k"] = torch.diff(meta.cu_seqlens_k)  # [prefills] int32
        self._step = (meta, step)
        return step


class FlashAttention(PagedAttention):
    """Paged attention through a `KernelProvider`; `provider=None` picks the first available
    one of PROVIDERS, raising when neither is."""

    name = "flash_attn"

    def __init__(self, provider: KernelProvider | None = None) -> None:
        self.provider = provider if provider is not None else make_provider()

    @property
    def kernel_name(self) -> str:
        return self.provider.kernel_name

    @property
    def block_multiple(self) -> int:
        return self.provider.block_multiple

    def __call__(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata,
                 scale: float, window: int = 0, softcap: float = 0.0) -> torch.Tensor:
        if q.dtype not in self.provider.dtypes:  # the kernel's own error says less
            names = ", ".join(str(d).removeprefix("torch.") for d in self.provider.dtypes)
            raise ValueError(f"attention_backend flash_attn ({self.kernel_name}) runs {names}, "
                             f"not {str(q.dtype).removeprefix('torch.')}")
        if softcap and not self.provider.softcap:
            raise ValueError(f"attention_backend flash_attn ({self.kernel_name}) has no "
                             f"soft-capping, which this model's attention needs")
        return super().__call__(q, k, v, k_cache, v_cache, meta, scale, window, softcap)

    def decode(self, q, k_cache, v_cache, meta: AttentionMetadata, scale: float,
               window: int = 0, softcap: float = 0.0) -> torch.Tensor:
        return self.provider.decode(q, k_cache, v_cache, meta, scale, window, softcap)

    def prefill(
        self, q, k, v, k_cache, v_cache, meta: AttentionMetadata, scale: float, window: int = 0,
        softcap: float = 0.0,
    ) -> torch.Tensor:
        return self.provider.prefill(q, k_cache, v_cache, meta, scale, window, softcap)


# -- provider selection ---------------------------------------------------------------------


def provider_missing(name: str) -> str | None:
    """Why provider `name` cannot run here, or None when it can. Imports nothing heavy."""
    if name == FLASH_ATTN:
        return None if importlib.util.find_spec("flash_attn") else "no flash-attn package"
    if name == TORCH_VARLEN:
        return _torch_varlen_missing()
    raise ValueError(f"unknown flash provider {name!r}, expected one of {PROVIDERS}")


def default_provider_name() -> str | None:
    """The provider `FlashAttention()` uses: flash-attn when installed, else torch's varlen."""
    return next((p for p in PROVIDERS if provider_missing(p) is None), None)


def make_provider(name: str | None = None) -> KernelProvider:
    """Provider `name` (default: `default_provider_name()`) with its real kernels."""
    name = name or default_provider_name()
    if name is None:
        raise RuntimeError(
            "attention_backend flash_attn needs the flash-attn package or torch>=2.13's "
            "torch.nn.attention.varlen.varlen_attn with block_table; found no flash-attn "
            f"package, and torch {torch.__version__}: {provider_missing(TORCH_VARLEN)}")
    missing = provider_missing(name)
    if missing:
        raise RuntimeError(f"flash provider {name} is unavailable: {missing}")
    return FlashAttnProvider() if name == FLASH_ATTN else TorchVarlenProvider()


def required_block_multiple(provider: str | None = None) -> int:
    """block_size must be a multiple of this for `provider` (default: the one picked here)."""
    provider = provider or default_provider_name()
    if provider is None:  # nothing to run: what every provider accepts
        return FLASH_BLOCK_MULTIPLE
    if provider not in BLOCK_MULTIPLES:
        raise ValueError(f"unknown flash provider {provider!r}, expected one of {PROVIDERS}")
    return BLOCK_MULTIPLES[provider]


def _torch_varlen_missing() -> str | None:
    # the build first: importing torch.nn.attention.varlen imports torch._dynamo (~1 s), which a
    # CPU-only torch need not pay to learn it has no flash kernel
    flash_built = getattr(torch.backends.cuda, "is_flash_attention_available", lambda: False)
    if not flash_built():
        return "built without CUDA flash attention"
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return "no torch.nn.attention.varlen.varlen_attn"
    params = inspect.signature(varlen_attn).parameters
    absent = [a for a in _VARLEN_ARGS if a not in params]
    if absent:
        return f"varlen_attn lacks {', '.join(absent)}"
    return None
