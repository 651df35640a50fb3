"""Per-request sampling parameters and their validation.

Sampling is applied in this order (see `kvserve.workers.model_executor.sampler`):
repetition penalty -> presence/frequency penalties -> temperature -> top-k -> top-p -> min-p.
`temperature == 0` (or below 1e-5) means greedy. `top_k` of 0 or -1 means off; `top_p == 1`
and `min_p == 0` mean off. Logprobs are those of the raw model distribution (before any
processing), like vLLM.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from typing import Any

from kvserve.workers.errors import InvalidRequestError

GREEDY_BELOW = 1e-5
STRUCTURED_KINDS = ("json", "json_object", "regex", "choice", "grammar")


@dataclass(frozen=True)
class StructuredOutputs:
    """A constraint on a request's output, vLLM's `structured_outputs`: exactly one of
    `json` (a JSON schema, kept as compact JSON text in its own key order: properties are
    generated in that order), `json_object` (any JSON object), `regex`, `choice` (one of these
    strings) or `grammar` (EBNF, as xgrammar reads it). The engine masks every step's logits
    to the tokens the constraint allows (`kvserve.workers.structured_output`)."""

    json: str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> StructuredOutputs:
        """From user input: {"json": schema (a dict or its text)} or {"regex": ...}, ...;
        unknown keys are refused by name."""
        if not isinstance(values, dict):
            raise InvalidRequestError("structured_outputs", "must be an object such as "
                                      '{"json": {...}}, {"regex": "..."} or {"choice": [...]}')
        for name in values:
            if name not in STRUCTURED_KINDS:
                raise InvalidRequestError("structured_outputs",
                                          f"unknown constraint {name!r} (one of "
                                          f"{', '.join(STRUCTURED_KINDS)})")
        values = dict(values)
        schema = values.get("json")
        if isinstance(schema, (dict, bool)):
            values["json"] = json.dumps(schema, separators=(",", ":"))
        elif isinstance(schema, str):
            try:
                values["json"] = json.dumps(json.loads(schema), separators=(",", ":"))
            except ValueError as exc:
                raise InvalidRequestError("structured_outputs",
                                          f"json: not a JSON schema ({exc})") from None
        if isinstance(values.get("choice"), list):
            values["choice"] = tuple(values["choice"])
        return cls(**values)

    def kinds(self) -> list[str]:
        """The constraints set (`validate` refuses any number but one)."""
        return [k for k in STRUCTURED_KINDS if getattr(self, k) not in (None, False)]

    @property
    def kind(self) -> str:
        return self.kinds()[0]

    def validate(self) -> None:
        set_ = self.kinds()
        if len(set_) != 1:
            raise InvalidRequestError("structured_outputs",
                                      f"set exactly one of {', '.join(STRUCTURED_KINDS)}, "
                                      f"not {len(set_)}")
        for name in ("json", "regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise InvalidRequestError("structured_outputs", f"{name}: must be a non-empty "
                                          "string")
        if not isinstance(self.json_object, bool):
            raise InvalidRequestError("structured_outputs", "json_object: must be a boolean")
        if self.choice is not None and (
                not self.choice or not all(isinstance(c, str) and c for c in self.choice)):
            raise InvalidRequestError("structured_outputs",
                                      "choice: must be a non-empty list of non-empty strings")


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0  # HF/CTRL style, over prompt and output tokens
    presence_penalty: float = 0.0  # OpenAI style, over output tokens
    frequency_penalty: float = 0.0  # OpenAI style, over output tokens
    seed: int | None = None  # None: a fresh random seed per request
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # top-n logprobs per generated token (0: only the sampled one)
    speculate: bool = True  # False: no speculative decoding for this request, if the engine has it
    # a constraint on the output (JSON schema, regex, choice, grammar); such a request does
    # not speculate
    structured_outputs: StructuredOutputs | None = None

    @property
    def greedy(self) -> bool:
        # below this, dividing logits by the temperature overflows float32: it is argmax anyway
        return self.temperature < GREEDY_BELOW

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> SamplingParams:
        """Build from user input, rejecting unknown fields by name."""
        known = {f.name for f in dataclasses.fields(cls)}
        for name in values:
            if name not in known:
                raise InvalidRequestError(name, "unknown sampling parameter")
        values = dict(values)
        for name in ("stop", "stop_token_ids"):
            if name in values:
                values[name] = _as_tuple(name, values[name])
        if isinstance(values.get("structured_outputs"), dict):
            values["structured_outputs"] = StructuredOutputs.from_dict(
                values["structured_outputs"])
        return cls(**values)

    def validate(self, vocab_size: int | None) -> None:
        """Raise InvalidRequestError naming the first bad field. `vocab_size` None: before a
        model is loaded (the CLI checks its flags before spending seconds on that), so the
        token ids are not checked against a vocabulary."""
        _check_int("max_tokens", self.max_tokens, low=1)
        _check_float("temperature", self.temperature, low=0.0)
        _check_float("top_p", self.top_p, low=0.0, high=1.0, low_open=True)
        _check_int("top_k", self.top_k, low=-1)
        _check_float("min_p", self.min_p, low=0.0, high=1.0)
        _check_float(
            "repetition_penalty", self.repetition_penalty, low=0.0, high=100.0, low_open=True
        )
        _check_float("presence_penalty", self.presence_penalty, low=-2.0, high=2.0)
        _check_float("frequency_penalty", self.frequency_penalty, low=-2.0, high=2.0)
        if self.seed is not None:
            _check_int("seed", self.seed, low=0, high=2**63 - 1)
        if self.logprobs is not None:
            _check_int("logprobs", self.logprobs, low=0, high=20)
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise InvalidRequestError("stop", "stop strings must be non-empty strings")
        for t in self.stop_token_ids:
            _check_int("stop_token_ids", t, low=0,
                       high=None if vocab_size is None else vocab_size - 1)
        for name in ("ignore_eos", "speculate"):
            if not isinstance(getattr(self, name), bool):
                raise InvalidRequestError(name, "must be a boolean")
        if self.structured_outputs is not None:
            if not isinstance(self.structured_outputs, StructuredOutputs):
                raise InvalidRequestError("structured_outputs",
                                          "must be StructuredOutputs or a dict")
            self.structured_outputs.validate()
            if self.ignore_eos:
                raise InvalidRequestError("ignore_eos", "cannot be combined with "
                                          "structured_outputs: the grammar's end is the end")


def _as_tuple(name: str, value: Any) -> tuple:
    if isinstance(value, str):
        return (value,)
    if isinstance(value, (list, tuple)):
        return tuple(value)
    raise InvalidRequestError(name, f"must be a list, got {type(value).__name__}")


def _check_int(name: str, value: Any, low: int, high: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidRequestError(name, f"must be an integer, got {value!r}")
    if value < low or (high is not None and value > high):
        bound = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise InvalidRequestError(name, f"must be {bound}, got {value}")


def _check_float(
    name: str, value: Any, low: float, high: float | None = None, low_open: bool = False
) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
        raise InvalidRequestError(name, f"must be a number, got {value!r}")
    too_low = value <= low if low_open else value < low
    if too_low or (high is not None and value > high) or math.isinf(value):
        left = "(" if low_open else "["
        right = f"{high}]" if high is not None else "inf)"
        raise InvalidRequestError(name, f"must be in {left}{low}, {right}, got {value}")
