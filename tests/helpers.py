"""Assertions shared by tests."""

from __future__ import annotations

import collections
import time
from collections.abc import Callable
from typing import Any, TypeVar

import torch
from torch.overrides import TorchFunctionMode

from kvserve.workers.core.sampling_params import SamplingParams
from kvserve.workers.core.sequence import Sequence
from kvserve.workers.engine import LLMEngine
from kvserve.workers.model_executor.loader import LoadedCheckpoint
from kvserve.workers.model_executor.tiny import tiny_checkpoint

T = TypeVar("T")


def make_seq(request_id: str, prompt_len: int, **params: Any) -> Sequence:
    """A sequence of prompt tokens 1..prompt_len with these sampling params, seeded: for
    block manager and scheduler units, which need no model."""
    return Sequence(request_id, list(range(1, prompt_len + 1)), SamplingParams(**params),
                    torch.Generator().manual_seed(0))


def assert_engine_idle(engine: LLMEngine) -> None:
    """Nothing running and every KV block back in the free pool."""
    assert not engine.has_unfinished()
    assert not engine.requests
    assert engine.block_manager.num_free == engine.block_manager.num_blocks
    host = engine.block_manager.host
    if host is not None:  # no swapped-out KV left behind: every host block free or cached
        assert len(host.free_ids) + len(host.cached) == host.num_blocks
        assert not host.pinned


def noisy_checkpoint(model_type: str, **overrides: Any) -> LoadedCheckpoint:
    """A tiny random checkpoint whose outputs depend on every tensor: a larger init range than
    HF's default, and noise on the norm weights and biases (HF initialises those to exactly 1
    and 0, which would hide a dropped bias or a misloaded norm)."""
    ckpt = tiny_checkpoint(model_type, seed=0, initializer_range=0.1, **overrides)
    gen = torch.Generator().manual_seed(1)
    for name, tensor in ckpt.tensors.items():
        if name.endswith(".bias") or name.endswith("norm.weight"):
            noise = torch.randn(tensor.shape, generator=gen) * 0.2
            ckpt.tensors[name] = tensor + noise
    return ckpt


def output_ids(outputs) -> list[int]:
    """All token ids of one request's stream of RequestOutputs."""
    return [t for o in outputs for t in o.token_ids]


def solo_ids(engine: LLMEngine, **request) -> list[int]:
    """The token ids of one request run alone to completion on `engine`."""
    return output_ids(next(iter(engine.generate_all([request]).values())))


def solo_ids_each(engine: LLMEngine, requests: list[dict]) -> list[list[int]]:
    """The token ids each request gets when run alone (`solo_ids`), computed in one batch: the
    kernels are batch-invariant (tests/test_batch_invariance.py proves each output in a batch
    equals its solo run), and one batch costs a fraction of the solo runs one after another."""
    outs = engine.generate_all([{**r, "request_id": f"solo-{i}"} for i, r in enumerate(requests)])
    return [output_ids(outs[f"solo-{i}"]) for i in range(len(requests))]


def poll(read: Callable[[], T], until: Callable[[T], bool], timeout_s: float,
         interval_s: float = 0.2) -> T:
    """`read()` every `interval_s` until `until(value)` or `timeout_s` has passed; the last
    value, so the caller asserts on what it saw (a timeout is not an error by itself)."""
    deadline = time.monotonic() + timeout_s
    value = read()
    while not until(value) and time.monotonic() < deadline:
        time.sleep(interval_s)
        value = read()
    return value


SYNCS = {"tolist", "cpu", "item", "__int__", "__float__", "__bool__", "__index__", "numpy"}
CREATIONS = {"tensor", "as_tensor", "from_numpy"}


def _has_list(index: Any) -> bool:
    items = index if isinstance(index, tuple) else (index,)
    return any(isinstance(i, list) for i in items)


class HostTraffic(TorchFunctionMode):
    """Counts, inside its block, what would cost a device->host sync (reading a tensor's values
    on the host), and host->device creations (a tensor built from host data: torch.tensor,
    torch.as_tensor, from_numpy, or indexing with a Python list) and transfers (`.to(device)`)."""

    def __init__(self) -> None:
        super().__init__()
        self.syncs = 0
        self.creations = 0
        self.transfers = 0
        self.calls: collections.Counter[str] = collections.Counter()

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        name = getattr(func, "__name__", str(func))
        self.calls[name] += 1
        if name in SYNCS:
            self.syncs += 1
        elif name in CREATIONS or (
            name in ("__getitem__", "__setitem__") and _has_list(args[1])
        ):
            self.creations += 1
        elif name in ("to", "cuda") and (
            "device" in kwargs or any(isinstance(a, (str, torch.device)) for a in args[1:])
        ):
            self.transfers += 1
        return func(*args, **kwargs)


def transformers_greedy_disagreements(hf_model: Any, prompt_ids: list[int], answer: list[int],
                                      max_tokens: int) -> list[str]:
    """Where transformers' greedy decoding of `prompt_ids` would not give `answer` (empty: it
    gives exactly `answer`). One forward call over prompt + answer, teacher-forced: by
    induction, greedy `generate()` yields `answer` iff at every step the argmax of transformers'
    logits, given the prompt and the answer so far, is the answer's next token, and it stops
    where the answer does (an EOS, or `max_tokens`). That is one prefill of the whole answer
    instead of one decode step per token (transformers' decode steps cost ~35 ms each here, so
    4 answers of up to 160 tokens took ~23 s through `generate()`); `generate()` itself stays
    the reference of tests/test_greedy_exact.py."""
    eos = hf_model.generation_config.eos_token_id
    eos = {eos} if isinstance(eos, int) else set(eos or ())
    problems = []
    if not answer or len(answer) > max_tokens:
        return [f"{len(answer)} tokens for a limit of {max_tokens}"]
    if len(answer) < max_tokens and answer[-1] not in eos:
        problems.append(f"stopped after {len(answer)} tokens without an EOS")
    if eos & set(answer[:-1]):
        problems.append(f"went on past an EOS: {answer}")
    ids = torch.tensor([prompt_ids + answer[:-1]])
    with torch.inference_mode():
        # logits only where an answer token is predicted (`logits_to_keep`): the prompt's
        # other rows would cost a vocab-wide projection each and are never read
        logits = hf_model(ids, attention_mask=torch.ones_like(ids),
                          logits_to_keep=len(answer)).logits[0]
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    best = logprobs.argmax(dim=-1).tolist()
    for step, (want, got) in enumerate(zip(best, answer, strict=True)):
        if want != got:
            gap = float(logprobs[step, want] - logprobs[step, got])
            problems.append(f"step {step}: transformers' argmax {want}, answer {got} "
                            f"(logprob gap {gap:.2e})")
            break  # later steps condition on a prefix transformers would not have produced
    return problems


def schema_errors(answers: dict[tuple[str, str], str]) -> list[str]:
    """(schema name, prompt) -> answer text: each answer that is not JSON valid against its
    schema in `kvserve.bench.structured.SCHEMAS`, and why."""
    import json

    import jsonschema

    from kvserve.bench.structured import SCHEMAS

    errors = []
    for (name, prompt), text in answers.items():
        try:
            jsonschema.validate(json.loads(text), SCHEMAS[name])
        except (ValueError, jsonschema.ValidationError) as exc:
            errors.append(f"{name} / {prompt}: {type(exc).__name__}: {text[:60]!r}")
    return errors
