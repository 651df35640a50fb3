"""The `triton` backend: kvserve's own FlashAttention-2 kernels over the paged cache
(`triton_kernels.py`), for CUDA; and on a CPU under Triton's interpreter, for tests.

Why a backend of our own beside flash_attn: FlashAttention's paged kernels want blocks of 256
tokens and choose their decode splits from the batch, so either a request's numbers depend on
its neighbours or long contexts decode on a few SMs; and their launches depend on the context
lengths, so a decode step cannot be replayed from a CUDA graph. These kernels take any block
size, split by context length alone, and launch on grids of batch size alone
(`supports_cuda_graphs`). With this backend the model also runs its Triton elementwise kernels
(`triton_ops`), whose RoPE kernel writes the step's K/V into the cache: the backend then only
attends (`attend`).

Importing this module imports no triton: the kernels load when the backend is made.
"""

from __future__ import annotations

import importlib.util
import os

import torch

from kvserve.workers.model_executor.attention.metadata import AttentionMetadata
from kvserve.workers.model_executor.attention.torch_backend import PagedAttention

INTERPRET_ENV = "TRITON_INTERPRET"


def interpreting() -> bool:
    """Triton's interpreter is on: kernels run in numpy on CPU tensors (tests only: ~1000x
    slower than a GPU)."""
    return os.environ.get(INTERPRET_ENV, "0").lower() in ("1", "true", "on", "yes")


def triton_missing(device: torch.device) -> str | None:
    """Why the triton backend cannot run on `device`, or None when it can. Imports nothing."""
    if importlib.util.find_spec("triton") is None:
        return "no triton package (it comes with CUDA builds of torch)"
    if device.type == "cuda":
        return None
    if device.type == "cpu" and interpreting():
        return None
    return (f"the triton backend runs on CUDA (on {device.type} only under Triton's "
            f"interpreter, {INTERPRET_ENV}=1, for tests)")


class TritonAttention(PagedAttention):
    """Paged attention in one Triton kernel for decodes, prefill chunks and mixed steps."""

    name = "triton"
    supports_cuda_graphs = True  # grids of batch size alone, no host sync
    fused_kv_write = True  # the model's triton_ops.rotary_write_kv_ fills the cache

    def __init__(self) -> None:
        import triton

        from kvserve.workers.model_executor.attention import triton_kernels

        self.kernels = triton_kernels
        self.kernel_name = f"kvserve triton {triton.__version__}" + (
            " (interpreter)" if interpreting() else "")
        # the interpreter's bf16 tl.dot is wrong: fp32 operands there (module docstring)
        self.dot_fp32 = interpreting()

    def attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
        k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
        window: int = 0, softcap: float = 0.0,
    ) -> torch.Tensor:
        # q: [tokens, heads, head_dim] -> [tokens, heads, head_dim]; k/v are in the cache
        return self.kernels.paged_attention(
            q, k_cache, v_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc,
            meta.num_decodes, scale, dot_fp32=self.dot_fp32,
            max_decode_context=meta.max_decode_context or None, window=window, softcap=softcap)
