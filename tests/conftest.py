"""Shared fixtures: a tiny random model for logic tests, the real SmolLM2 for acceptance tests."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from workers.config import EngineConfig
from workers.engine import LLMEngine
from workers.model_executor.cpu_kernels import load_cpu_kernels
from workers.model_executor.loader import cache_root, resolve_model_dir
from workers.model_executor.tiny import tiny_checkpoint

# Fixtures that load the real SmolLM2 (or convert it): a test using one is `slow`.
REAL_MODEL_FIXTURES = frozenset({"model_dir", "real_engine", "hf_model"})


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by marker
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark `slow` every test that loads the real model through a shared fixture or starts Ray
    (marked `ray`), so `pytest -m "not slow"` is the fast suite without listing each test: a new
    test asking for `real_engine` is slow without anyone remembering to mark it. Tests that load
    the model another way (their own engine, a `kvserve` subprocess) are marked where written."""
    for item in items:
        if item.get_closest_marker("ray") or REAL_MODEL_FIXTURES & set(
            getattr(item, "fixturenames", ())
        ):
            item.add_marker(pytest.mark.slow)


@pytest.fixture(scope="session")
def model_dir() -> Path:
    """The default model converted to safetensors (converted once, then cached)."""
    return resolve_model_dir(None)


@pytest.fixture(scope="session")
def real_engine(model_dir: Path) -> LLMEngine:
    """SmolLM2-135M-Instruct, fp32 on CPU, a 1 GiB KV pool. Shared: tests must leave it idle."""
    return LLMEngine(EngineConfig(kv_cache_memory=1024**3, device="cpu"))


@pytest.fixture(scope="session")
def hf_model(model_dir: Path):
    """transformers' own model on the same weights, the reference for exactness."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def cpu_kernels():
    """kvserve's C++ CPU kernels, built (or reused) in the cache directory."""
    kernels = load_cpu_kernels(cache_root() / "kernels")
    assert kernels is not None, "the kernels must build on this machine"
    return kernels


@pytest.fixture(scope="module")
def one_torch_thread() -> Iterator[None]:
    """Tiny models on two shared cores: one intra-op thread is several times faster than two."""
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
