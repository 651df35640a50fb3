"""Shared fixtures: a tiny random model for logic tests, the real SmolLM2 for acceptance tests.

How the suite is split and scheduled (slow and ray markers, xdist units, the shared Ray
cluster's lifetime) is the plugin `tests/suite_plugin.py`, registered here."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

# Without a GPU, Triton's kernels (the triton attention backend, kvserve/workers/model_executor/
# triton_ops.py) run under Triton's interpreter on CPU tensors. Triton reads this when a kernel
# module is imported, so it is set here, before any test imports one.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from kvserve.workers.config import EngineConfig  # noqa: E402
from kvserve.workers.engine import LLMEngine  # noqa: E402
from kvserve.workers.model_executor.cpu_kernels import load_cpu_kernels  # noqa: E402
from kvserve.workers.model_executor.loader import (  # noqa: E402
    LoadedCheckpoint,
    load_checkpoint,
    resolve_model_dir,
)
from kvserve.workers.model_executor.tiny import tiny_checkpoint  # noqa: E402

pytest_plugins = ["tests.suite_plugin"]


@pytest.fixture(scope="session")
def model_dir() -> Path:
    """The default model converted to safetensors (converted once, then cached)."""
    return resolve_model_dir(None)


@pytest.fixture(scope="session")
def real_checkpoint(model_dir: Path) -> LoadedCheckpoint:
    """The default model's weights, config and tokenizer, read once: engines with other
    settings pass it as `checkpoint=` rather than reading and parsing the files again.
    (Engines take these tensors as their own parameters where dtype and shape match, and fuse
    copies of the rest (kvserve/workers/model_executor/model.py `load_checkpoint`); nothing writes
    to
    them.)"""
    return load_checkpoint(None)


@pytest.fixture(scope="session")
def real_engine(real_checkpoint: LoadedCheckpoint) -> LLMEngine:
    """SmolLM2-135M-Instruct, fp32 on CPU, a 1 GiB KV pool. Shared: tests must leave it idle."""
    return LLMEngine(EngineConfig(kv_cache_memory=1024**3, device="cpu"),
                     checkpoint=real_checkpoint)


@pytest.fixture(scope="session")
def hf_model(model_dir: Path):
    """transformers' own model on the same weights, the reference for exactness."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def cpu_kernels():
    """kvserve's C++ CPU kernels, built (or reused) in the cache directory."""
    kernels = load_cpu_kernels()
    assert kernels is not None, "the kernels must build on this machine"
    return kernels


@pytest.fixture(scope="module", params=["avx512", "avx2"])
def isa_kernels(cpu_kernels, request):
    """The kernels on one instruction set (`linear`, `linear_codes`, `linear_bf16` and the bf16
    elementwise ops): each test runs on both where the CPU has both (AVX-512 CPUs have AVX2),
    on AVX2 alone on an AVX2-only CPU."""
    try:
        cpu_kernels.set_linear_isa(request.param)
    except RuntimeError:
        pytest.skip(f"the kernels on {request.param}: not built, or not on this CPU")
    assert cpu_kernels.linear_available() and cpu_kernels.linear_isa() == request.param
    yield cpu_kernels
    cpu_kernels.set_linear_isa("")  # the best this CPU has


@pytest.fixture
def one_torch_thread() -> Iterator[None]:
    """Tiny models on two shared cores: one intra-op thread is several times faster than two.
    Per test, not per module: a real-model test later in the same module gets both threads
    back (module scope left the 32-request swap test on one thread, at 2.5x its time)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def make_tiny_engine():
    """Factory: a tiny random Llama engine; kwargs go to EngineConfig."""

    def make(
        model_type: str = "llama", checkpoint_kwargs: dict | None = None, **config
    ) -> LLMEngine:
        config.setdefault("kv_cache_memory", 4 * 1024**2)
        config.setdefault("device", "cpu")
        ckpt = tiny_checkpoint(model_type, **(checkpoint_kwargs or {}))
        return LLMEngine(EngineConfig(**config), checkpoint=ckpt)

    return make
