"""Hugging Face peer baselines for the throughput benchmark, plus a roofline helper.

Three baselines run the same greedy workload (every request emits exactly `output_len` new
tokens) and return each request's tokens, so tests can check they compute the same thing:

- `hf_generate_sequential`: `model.generate` one request at a time (no batching at all).
- `hf_generate_padded`: `model.generate` on static batches, prompts padded on the left.
- `hf_generate_batch`: transformers' own continuous batching (`model.generate_batch`, a paged KV
  cache and a scheduler running in a background thread).

`measure_memory_bandwidth` and `weight_bytes_per_decode_step` give the memory-bound ceiling of a
decode step: `bandwidth / weight_bytes` steps per second.
"""

from __future__ import annotations

import inspect
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from transformers import PreTrainedModel

# What the paged KV cache and the attention masks of `generate_batch` may take, in bytes. Without
# explicit sizes transformers grabs 60 % of the machine's RAM for the cache on CPU.
CB_CACHE_BUDGET = 2 * 2**30
CB_MASK_BUDGET = 1 * 2**30
CB_DEFAULT_MAX_BATCH_TOKENS = 8192  # transformers' own default
CB_PAGE_SIZE = 256  # transformers' own default


@dataclass
class ThroughputResult:
    """Output tokens produced by a baseline and the wall time it took; `tokens`: each request's
    new tokens, in the order of the prompts."""

    name: str
    output_tokens: int
    seconds: float
    tokens: list[list[int]] = field(default_factory=list, repr=False)

    @property
    def tok_s(self) -> float:
        """Output tokens per second."""
        return self.output_tokens / self.seconds if self.seconds > 0 else 0.0


def load_hf_model(
    model_dir: Path, attn_implementation: str = "sdpa", dtype: torch.dtype = torch.float32
) -> PreTrainedModel:
    """Load a local HF checkpoint directory (never the hub) as a CPU model in eval mode."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        str(model_dir),
        dtype=dtype,
        attn_implementation=attn_implementation,
        local_files_only=True,
    )
    return model.to("cpu").eval()


def _greedy_config(output_len: int, **extra: Any) -> Any:
    """A greedy GenerationConfig for `output_len` new tokens."""
    from transformers import GenerationConfig

    return GenerationConfig(do_sample=False, max_new_tokens=output_len, **extra)


@torch.inference_mode()
def hf_generate_sequential(
    model: PreTrainedModel, prompts: list[list[int]], output_len: int
) -> ThroughputResult:
    """`model.generate` one request at a time, greedy, exactly `output_len` new tokens each.

    `min_new_tokens == max_new_tokens` masks EOS, so no request stops early. One untimed 1-token
    call warms torch up (as `hf_generate_batch` does); the wall time covers the whole loop and new
    tokens are counted from the returned sequences.
    """
    pad = model.config.pad_token_id
    pad = pad if pad is not None else 0
    config = _greedy_config(output_len, min_new_tokens=output_len, pad_token_id=pad)
    if prompts:
        warm = torch.tensor([prompts[0]], dtype=torch.long)
        model.generate(
            input_ids=warm,
            attention_mask=torch.ones_like(warm),
            max_new_tokens=1,
            do_sample=False,
            pad_token_id=pad,
        )
    tokens: list[list[int]] = []
    start = time.perf_counter()
    for prompt in prompts:
        input_ids = torch.tensor([prompt], dtype=torch.long)
        out = model.generate(
            input_ids=input_ids,
            attention_mask=torch.ones_like(input_ids),
            generation_config=config,
        )
        tokens.append(out[0, input_ids.shape[1]:].tolist())
    seconds = time.perf_counter() - start
    return ThroughputResult("hf_generate_sequential", sum(map(len, tokens)), seconds, tokens)


@torch.inference_mode()
def hf_generate_padded(
    model: PreTrainedModel, prompts: list[list[int]], output_len: int, batch_size: int = 8
) -> ThroughputResult:
    """`model.generate` on static batches of `batch_size` prompts, greedy, `output_len` each.

    The static batching a user gets from plain `generate()`: each batch is padded on the left
    (the new tokens of every row then sit at the same positions) with an attention mask that
    hides the padding, and runs until its last request is done. Same-length prompts (as
    `make_prompts` makes) need no padding. Warm-up and token counting as `hf_generate_sequential`.
    """
    pad = model.config.pad_token_id
    pad = pad if pad is not None else 0
    config = _greedy_config(output_len, min_new_tokens=output_len, pad_token_id=pad)
    if prompts:
        warm = torch.tensor([prompts[0]], dtype=torch.long)
        model.generate(input_ids=warm, attention_mask=torch.ones_like(warm), max_new_tokens=1,
                       do_sample=False, pad_token_id=pad)
    tokens: list[list[int]] = []
    start = time.perf_counter()
    for first in range(0, len(prompts), max(1, batch_size)):
        batch = prompts[first:first + max(1, batch_size)]
        width = max(map(len, batch))
        input_ids = torch.tensor([[pad] * (width - len(p)) + p for p in batch], dtype=torch.long)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch],
                            dtype=torch.long)
        out = model.generate(input_ids=input_ids, attention_mask=mask, generation_config=config)
        tokens.extend(row.tolist() for row in out[:, width:])
    seconds = time.perf_counter() - start
    return ThroughputResult("hf_generate_padded", sum(map(len, tokens)), seconds, tokens)


def _kv_bytes_per_token(config: Any, dtype: torch.dtype) -> int:
    """Bytes of K and V cached per token over all layers."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    element = torch.empty((), dtype=dtype).element_size()
    return 2 * config.num_hidden_layers * kv_heads * head_dim * element


def cb_config_for(model: PreTrainedModel, prompts: list[list[int]], output_len: int) -> Any:
    """A ContinuousBatchingConfig sized for this workload and capped by the byte budgets above.

    The cache holds every request at once when the budget allows (transformers' scheduler queues
    the rest otherwise); the attention masks ([1, 1, M, N + M] fp32 with SDPA) bound the batch
    token count M. Flash attention is never switched to, so SDPA is what gets measured.
    """
    from transformers import ContinuousBatchingConfig

    text_config = model.config.get_text_config()
    block_bytes = CB_PAGE_SIZE * _kv_bytes_per_token(text_config, model.dtype)
    needed = sum(math.ceil((len(p) + output_len) / CB_PAGE_SIZE) for p in prompts) + 1
    num_blocks = max(2, min(needed, CB_CACHE_BUDGET // block_bytes))
    cache_tokens = num_blocks * CB_PAGE_SIZE
    max_batch_tokens = min(CB_DEFAULT_MAX_BATCH_TOKENS, max(CB_PAGE_SIZE, sum(map(len, prompts))))
    while max_batch_tokens > CB_PAGE_SIZE and (
        4 * max_batch_tokens * (cache_tokens + max_batch_tokens) > CB_MASK_BUDGET
    ):
        max_batch_tokens //= 2
    # transformers 5.17 (the H200 machine's) names the page `block_size` and has no
    # `auto_switch_to_flash` (nor switches); 5.25 has both: pass what the installed class takes
    accepted = inspect.signature(ContinuousBatchingConfig.__init__).parameters
    page = "page_size" if "page_size" in accepted else "block_size"
    options = {page: CB_PAGE_SIZE, "num_blocks": num_blocks, "max_batch_tokens": max_batch_tokens,
               "max_requests_per_batch": max(1, min(len(prompts), 1024)),
               "auto_switch_to_flash": False}
    return ContinuousBatchingConfig(**{k: v for k, v in options.items() if k in accepted})


@torch.no_grad()
def hf_generate_batch(
    model: PreTrainedModel, prompts: list[list[int]], output_len: int
) -> ThroughputResult:
    """transformers' continuous batching (`model.generate_batch`), greedy, `output_len` tokens each.

    The model must use attn_implementation "sdpa" (or "eager", which transformers switches to
    "paged|eager"); the "paged|" prefix is deprecated for SDPA in transformers 5.x. The manager
    (paged cache allocation plus `warmup`, a no-op on CPU where there are no CUDA graphs) is built
    by an untimed call on a short dummy prompt and kept alive (`persistent_manager=True`); the
    timed call reuses it, so only the generation is timed. The dummy prompt fills no whole page,
    so the timed requests cannot hit the prefix cache with it.

    Runs under `no_grad` (as `generate_batch` itself does), never in inference mode, even inside
    a caller's: `warmup` allocates the batch's static tensors in this thread, and the generation
    loop resets them in place in a background thread. Inference mode is thread-local and 5.17's
    loop (the H200 machine's) runs without it, so tensors made in inference mode could not be
    updated there: every request failed with "Inplace update to inference tensor outside
    InferenceMode is not allowed". From 5.24 on the thread takes the
    caller's mode; no inference mode at all works the same in every version.

    Raises, with each failed request's error, if the dummy or the timed call loses a request,
    fails one, or returns other than `output_len` tokens for one.
    """
    if not prompts:
        return ThroughputResult("hf_generate_batch", 0, 0.0)
    # eos_token_id=-1 disables EOS in continuous batching (min_new_tokens would add a logits
    # processor, which costs time and memory there)
    gen_config = _greedy_config(output_len, eos_token_id=-1)
    cb_config = cb_config_for(model, prompts, output_len)
    kwargs = {"generation_config": gen_config, "continuous_batching_config": cb_config}
    model.destroy_cached_continuous_batching_manager()  # never reuse one sized for another load
    with torch.inference_mode(False):
        try:
            dummy = [[1, 2, 3, 4]]
            warm = model.generate_batch(dummy, max_new_tokens=2, persistent_manager=True,
                                        **kwargs)
            _check_batch_outputs(warm, dummy, 2, "the untimed warm-up call")
            start = time.perf_counter()
            outputs = model.generate_batch(prompts, persistent_manager=True, **kwargs)
            seconds = time.perf_counter() - start
        finally:
            model.destroy_cached_continuous_batching_manager()
    tokens = _check_batch_outputs(outputs, prompts, output_len, "the timed call")
    return ThroughputResult("hf_generate_batch", sum(map(len, tokens)), seconds, tokens)


def _check_batch_outputs(
    outputs: dict[str, Any], prompts: list[list[int]], output_len: int, call: str
) -> list[list[int]]:
    """Each prompt's generated tokens from `generate_batch`'s outputs (5.17 and 5.25 return
    them in the order of the inputs, checked here by prompt), or a RuntimeError naming each
    failed, short or misplaced request and its error text."""
    problems = [f"{key}: {out.error}" for key, out in outputs.items() if out.error is not None]
    problems += [f"{key}: {len(out.generated_tokens)} tokens, not {output_len}"
                 for key, out in outputs.items()
                 if out.error is None and len(out.generated_tokens) != output_len]
    problems += [f"{key}: prompt is not request {i}'s" for i, (key, out)
                 in enumerate(outputs.items()) if out.error is None and i < len(prompts)
                 and list(out.prompt_ids) != list(prompts[i])]
    if len(outputs) != len(prompts) or problems:
        raise RuntimeError(f"generate_batch ({call}) returned {len(outputs)}/{len(prompts)} "
                           f"results, failed: {'; '.join(problems)[:2000]}")
    return [list(out.generated_tokens) for out in outputs.values()]


def measure_memory_bandwidth(num_bytes: int = 512 * 2**20, repeats: int = 5) -> float:
    """Bytes per second of a read-bound op (torch sum over a cache-busting fp32 tensor), best of
    `repeats`, with torch's current intra-op threads."""
    data = torch.ones(max(1, num_bytes // 4), dtype=torch.float32)
    data.sum()  # first touch and thread-pool start-up stay out of the timing
    best = math.inf
    for _ in range(max(1, repeats)):
        start = time.perf_counter()
        data.sum()
        best = min(best, time.perf_counter() - start)
    return data.numel() * data.element_size() / best


def decode_step_weights(model: torch.nn.Module) -> list[torch.Tensor]:
    """The weights one decode step reads: every parameter once, except embedding tables (a
    lookup reads one row per token). A tied lm_head shares the table and counts through it; a
    packed one (oneDNN or kvserve's kernels) is a separate tensor of the same size."""
    seen: dict[int, torch.Tensor] = {}
    for module in model.modules():
        if not isinstance(module, torch.nn.Embedding):
            for tensor in module.parameters(recurse=False):
                seen.setdefault(id(tensor), tensor)
    return list(seen.values())


def weight_bytes_per_decode_step(model: torch.nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in decode_step_weights(model))


def weights_read_seconds(model: torch.nn.Module, repeats: int = 5) -> float:
    """Seconds to read every weight of a decode step once (a `sum()` each, best of `repeats`):
    the bandwidth bound for the memory the weights actually live in, which on a VM can read
    slower than the fresh buffer `measure_memory_bandwidth` sums."""
    weights = [_as_fp32_bytes(t) for t in decode_step_weights(model)]
    best = math.inf
    for _ in range(max(1, repeats)):
        start = time.perf_counter()
        for tensor in weights:
            tensor.sum()
        best = min(best, time.perf_counter() - start)
    return best


def _as_fp32_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """The same bytes seen as fp32, where they can be: a bf16 `sum()` converts every element
    and runs ~1.4x slower than the read it is meant to time (measured here), an fp32 one is
    bound by the read. A oneDNN-packed weight (CPUs without AVX-512: no kvserve kernels) has no
    `sum()`: its dense copy, the same number of bytes, stands in for it."""
    if tensor.is_mkldnn:
        tensor = tensor.to_dense()
    if tensor.dtype == torch.float32 or not tensor.is_contiguous():
        return tensor
    flat = tensor.reshape(-1)
    if (flat.numel() * flat.element_size()) % 4:
        return tensor
    return flat.view(torch.uint8).view(torch.float32)
