"""Which slice of each weight a tensor-parallel rank holds, and which sizes a tp size must
divide: pure functions of the model's config and a checkpoint's tensor names.

The split is Megatron's, as vLLM and nano-vllm make it: a column-parallel projection (q, k, v
by heads, gate and up by columns) keeps rows of its [out, in] weight, so each rank computes
its own heads or columns whole; a row-parallel one (o_proj, down_proj) keeps columns, so each
rank computes a partial sum of every output, and one all-reduce adds them. Bias: a
column-parallel one is sliced with its rows; a row-parallel one is added once, by rank 0
(zeros on the others). The embedding and the LM head keep rows of the vocabulary.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvserve.workers.errors import EngineConfigError

if TYPE_CHECKING:
    import torch

    from kvserve.workers.parallel.group import TPGroup

# the last name before .weight/.bias -> the dim its [out, in] weight is split along
COLUMN_PARALLEL = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "embed_tokens",
                   "lm_head")
ROW_PARALLEL = ("o_proj", "down_proj")


def head_dim(config: Any) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def check_divisible(config: Any, tp: int, name: str | None = None) -> None:
    """Refuse a tp size the model (`name`) cannot be split by, naming the field and the numbers
    (SmolLM2-135M: 9 heads and 3 KV heads, so tp 3 works and tp 2 does not)."""
    if tp < 1:
        raise EngineConfigError("tensor_parallel_size", f"tensor_parallel_size must be "
                                                        f"positive, not {tp}")
    if tp == 1:
        return
    name = name or getattr(config, "name_or_path", "") or f"this {config.model_type} model"
    from kvserve.workers.model_executor.families import family_of

    if not family_of(config).tensor_parallel:
        raise EngineConfigError(
            "tensor_parallel_size", f"tensor_parallel_size {tp}: {name} is a "
                                    f"{config.model_type!r} model, which kvserve does not split "
                                    f"over ranks (`kvserve models` says which do)")
    for field in ("num_attention_heads", "num_key_value_heads", "vocab_size",
                  "intermediate_size"):
        value = getattr(config, field)
        if value % tp:
            divisors = [d for d in range(1, value + 1) if value % d == 0 and d <= 64]
            raise EngineConfigError(
                "tensor_parallel_size",
                f"tensor_parallel_size {tp} does not divide {field} {value} of {name}: each "
                f"rank holds an equal share of it; sizes that divide it: "
                f"{', '.join(map(str, divisors))}")


def vocab_range(config: Any, tp: TPGroup | None) -> tuple[int, int]:
    """(rows, first row) of the vocabulary this rank holds."""
    if tp is None:
        return config.vocab_size, 0
    rows = config.vocab_size // tp.size
    return rows, rows * tp.rank


def split_dim(name: str) -> int | None:
    """The dim a checkpoint tensor is split along (0: rows, 1: columns), None if whole on
    every rank (norms). A row-parallel bias: None (added by rank 0 alone)."""
    parts = name.split(".")
    if len(parts) < 2:
        return None
    module, kind = parts[-2], parts[-1]
    if module in COLUMN_PARALLEL:
        return 0
    if module in ROW_PARALLEL:
        return 1 if kind == "weight" else None
    return None


def is_row_parallel_bias(name: str) -> bool:
    parts = name.split(".")
    return len(parts) >= 2 and parts[-2] in ROW_PARALLEL and parts[-1] == "bias"


def slice_checkpoint(tensors: dict[str, torch.Tensor], rank: int,
                     size: int) -> dict[str, torch.Tensor]:
    """Each tensor's slice for `rank` of `size`: views of the loader's tensors where the slice
    is contiguous (rows), so a rank reads and keeps only its share of a memory-mapped
    checkpoint; a copy of the columns otherwise."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        dim = split_dim(name)
        if dim is not None:
            step = tensor.shape[dim] // size
            part = tensor.narrow(dim, rank * step, step)
            out[name] = part if part.is_contiguous() else part.contiguous()
        elif is_row_parallel_bias(name) and rank > 0:
            out[name] = tensor.new_zeros(tensor.shape)  # the sum adds rank 0's alone
        else:
            out[name] = tensor
    return out
