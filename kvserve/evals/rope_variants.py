"""RoPE scaling variants for the recall eval, as transformers' `rope_parameters` overrides.

`none` runs the model as trained; `linear:F`, `dynamic:F` (NTK), `yarn:F`, `llama3:F` and
`longrope:F` scale by factor F, with the type's own keys at transformers' defaults unless given
after the factor: `yarn:4,beta_fast=32`. The engine evaluates transformers' own RoPE code with the
override (kvserve.workers.model_executor.rope), so the math is Hugging Face's;
`original_max_position_embeddings` defaults to the trained context, and longrope's per-frequency
factors to uniform ones (kvserve/workers/model_executor/loader.py: `override_rope`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

TYPES = ("linear", "dynamic", "yarn", "llama3", "longrope")
LLAMA3_DEFAULTS = {"low_freq_factor": 1.0, "high_freq_factor": 4.0}


@dataclass(frozen=True)
class RopeVariant:
    name: str  # as the user wrote it, e.g. "yarn:2"
    rope_parameters: dict[str, Any] | None  # None: as trained

    @property
    def slug(self) -> str:
        """A file-name-safe form: yarn:2 -> yarn-2."""
        return self.name.replace(":", "-").replace(",", "_").replace("=", "")


def parse_rope_variant(spec: str) -> RopeVariant:
    spec = spec.strip()
    if spec in ("none", "default"):
        return RopeVariant("none", None)
    rope_type, _, rest = spec.partition(":")
    if rope_type not in TYPES or not rest:
        raise ValueError(f"--rope {spec!r}: expected none or TYPE:FACTOR with TYPE one of "
                         f"{', '.join(TYPES)} (e.g. yarn:2)")
    factor, *extras = rest.split(",")
    params: dict[str, Any] = {"rope_type": rope_type, "factor": _number(spec, factor)}
    if rope_type == "llama3":
        params |= LLAMA3_DEFAULTS
    for extra in extras:
        key, sep, value = extra.partition("=")
        if not sep:
            raise ValueError(f"--rope {spec!r}: {extra!r} is not KEY=VALUE")
        key = key.strip()
        number = _number(spec, value)
        params[key] = int(number) if key.endswith("position_embeddings") else number
    if params["factor"] < 1:
        raise ValueError(f"--rope {spec!r}: the factor must be >= 1")
    return RopeVariant(spec, params)


def _number(spec: str, text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise ValueError(f"--rope {spec!r}: {text!r} is not a number") from None
