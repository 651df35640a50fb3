"""Decode steps through CUDA graphs (kvserve/workers/model_executor/cuda_graphs.py) and the triton
backend in the engine.

Without a GPU the graphs' static-buffer path runs eagerly (`capture=False`): the bucket choice,
the padding rows, the slicing of results and the KV pool are the same code as on CUDA, where
only the replay differs. The claims: tokens equal the eager path's exactly; padding rows never
write KV (with a control that leaves stale rows in place and sees the pool change); the triton
backend's greedy tokens equal the torch backend's. The `gpu` tests capture for real.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")
pytestmark = pytest.mark.triton

from kvserve.workers.builder import kv_budget, uses_graphs  # noqa: E402
from kvserve.workers.config import EngineConfig  # noqa: E402
from kvserve.workers.engine import LLMEngine  # noqa: E402
from kvserve.workers.model_executor.attention import make_backend  # noqa: E402
from kvserve.workers.model_executor.cuda_graphs import (  # noqa: E402
    DecodeGraphs,
    graph_batch_sizes,
    graph_memory_bytes,
    padded_size,
)
from kvserve.workers.model_executor.tiny import tiny_checkpoint  # noqa: E402
from tests.helpers import assert_engine_idle  # noqa: E402

GREEDY = {"temperature": 0, "max_tokens": 6, "ignore_eos": True}
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # the interpreter's without a GPU


@pytest.fixture(scope="module")
def checkpoint():
    return tiny_checkpoint("llama", initializer_range=0.2)


@pytest.fixture(scope="module")
def triton_tokens(checkpoint) -> list[list[int]]:
    """The triton backend's eager greedy tokens, the reference of the graph path."""
    return _greedy(_engine(checkpoint))


def _engine(checkpoint, backend="triton", **config) -> LLMEngine:
    """Eager unless a test asks for graphs (fp32: the exactness reference)."""
    config = {"kv_cache_memory": 16 * 2**20, "max_num_batched_tokens": 64, "max_num_seqs": 8,
              "device": DEVICE, "attention_backend": backend, "enforce_eager": True, **config}
    return LLMEngine(EngineConfig(**config), checkpoint=checkpoint)


def _greedy(engine: LLMEngine, lengths=(3, 40, 90), max_tokens=(6, 4, 2)) -> list[list[int]]:
    """Prompts that need chunked prefill (64-token budget) and finish at different steps, so
    the decode batch shrinks 3 -> 2 -> 1 (buckets 4, 2, 1)."""
    reqs = [{"prompt_token_ids": list(range(5, 5 + n)), "params": {**GREEDY, "max_tokens": m}}
            for n, m in zip(lengths, max_tokens, strict=True)]
    out = engine.generate_all(reqs)
    assert_engine_idle(engine)
    return [[t for o in outs for t in o.token_ids] for outs in out.values()]


def test_batch_sizes_are_powers_of_two_up_to_max_num_seqs():
    assert graph_batch_sizes(1) == [1]
    assert graph_batch_sizes(64) == [1, 2, 4, 8, 16, 32, 64]
    assert graph_batch_sizes(48) == [1, 2, 4, 8, 16, 32, 48]
    sizes = graph_batch_sizes(48)
    assert [padded_size(n, sizes) for n in (1, 3, 5, 33, 48, 49)] == [1, 4, 8, 48, 48, None]


def test_the_triton_backend_gives_the_torch_backends_greedy_tokens(checkpoint, triton_tokens):
    triton = _engine(checkpoint)
    assert triton.info.attention_backend == "triton"
    assert triton.model.triton_ops is not None  # its norms, activation and RoPE+KV write too
    assert triton_tokens == _greedy(_engine(checkpoint, "torch"))


def test_decode_graphs_give_the_eager_paths_tokens(checkpoint, triton_tokens):
    engine = _engine(checkpoint)
    engine.runner.enable_decode_graphs(graph_batch_sizes(8), engine.max_model_len, capture=False)
    assert _greedy(engine) == triton_tokens
    replays = engine.runner.graphs.replays
    assert replays[4] and replays[1]  # three decodes padded to four, and one alone


def test_decode_graphs_stack_a_rope_per_layer_type():
    """Gemma 3's cos/sin, a block per layer type, through the graphs' static buffers (two
    blocks of rows): the eager path's tokens, with sliding windows and q/k norms on the way."""
    from tests.helpers import noisy_checkpoint
    from tests.test_model_support import GEMMA3

    gemma3 = noisy_checkpoint("gemma3_text", **GEMMA3)
    short = {"lengths": (3, 20, 40), "max_tokens": (6, 4, 2)}  # past its 32-token window
    eager = _greedy(_engine(gemma3), **short)
    engine = _engine(gemma3)
    engine.runner.enable_decode_graphs(graph_batch_sizes(8), engine.max_model_len, capture=False)
    assert engine.runner.graphs.cos.shape[0] == 2
    assert _greedy(engine, **short) == eager
    assert engine.runner.graphs.replays[4] and engine.runner.graphs.replays[1]


def _decode_four_then_one(engine: LLMEngine) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Four requests decode together (their slots fill the graph's static rows), then three
    are aborted and the last decodes alone, padded to four. -> the pool (k of every layer,
    zeroed) before and after that last step, and the slot its token was written to."""
    ids = [engine.add_request(prompt_token_ids=list(range(7, 7 + n)),
                              params={**GREEDY, "max_tokens": 20}) for n in (5, 9, 12, 30)]
    while engine.scheduler_stats().num_decoding < 4:
        engine.step()
    engine.step()  # four decode rows through the size-4 graph
    for rid in ids[:3]:
        engine.abort(rid)
    for k, _ in engine.runner.kv_cache:  # so that any write shows, even of the same values
        k.zero_()
    before = torch.stack([k.clone() for k, _ in engine.runner.kv_cache])
    seen = []
    stop = engine.observe_forward(lambda view: seen.append(view.slot_mapping.tolist()))
    engine.step()
    stop()
    engine.abort(ids[3])
    after = torch.stack([k for k, _ in engine.runner.kv_cache])
    return before, after, seen[0]


def _changed_slots(before: torch.Tensor, after: torch.Tensor) -> set[int]:
    # k pools: [layers, blocks, block_size, kv_heads, dim] -> slots whose keys changed
    changed = (before != after).flatten(3).any(-1).any(0).flatten()
    return set(changed.nonzero().flatten().tolist())


def test_padding_rows_never_write_kv(checkpoint):
    engine = _engine(checkpoint)
    engine.runner.enable_decode_graphs([4], engine.max_model_len, capture=False)
    before, after, slots = _decode_four_then_one(engine)
    assert len(slots) == 1
    assert _changed_slots(before, after) == set(slots)
    assert_engine_idle(engine)


def test_stale_padding_rows_would_overwrite_other_requests_kv(checkpoint, monkeypatch):
    """Negative control: rows left as the earlier, larger step wrote them (no padding) write
    their stale slots again, and the comparison above sees it."""
    monkeypatch.setattr(DecodeGraphs, "_pad_from", lambda self, rows, end=None: None)
    engine = _engine(checkpoint)
    engine.runner.enable_decode_graphs([4], engine.max_model_len, capture=False)
    before, after, slots = _decode_four_then_one(engine)
    assert _changed_slots(before, after) > set(slots)


def test_graphs_only_for_cuda_and_backends_with_length_free_grids(checkpoint):
    triton, torch_backend = make_backend("triton"), make_backend("torch")
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert uses_graphs(EngineConfig(), cuda, triton)
    assert not uses_graphs(EngineConfig(enforce_eager=True), cuda, triton)
    assert not uses_graphs(EngineConfig(), cuda, torch_backend)
    assert not uses_graphs(EngineConfig(), cpu, triton)
    if DEVICE == "cpu":  # a CPU engine captures nothing, enforce_eager or not
        assert _engine(checkpoint, enforce_eager=False).info.cuda_graph_sizes == ()
    engine = _engine(checkpoint, "torch")
    with pytest.raises(ValueError, match="cannot run in CUDA graphs"):
        engine.runner.enable_decode_graphs([1], 64, capture=False)


def test_graph_memory_comes_out_of_the_kv_budget(monkeypatch):
    gib = 2**30
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (70 * gib, 80 * gib))
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 8 * gib)
    config = EngineConfig(gpu_memory_utilization=0.9)
    without = kv_budget(config, torch.device("cuda"))
    graphs = graph_memory_bytes(256, 8192, 2048, 32, 8, 64, 8192, torch.bfloat16)
    assert kv_budget(config, torch.device("cuda"), graphs) == without - graphs
    assert 10 * 2**20 < graphs < gib  # Llama-3.2-1B's shape at 256 rows: tens of MiB
    # an explicit pool size is the pool size
    assert kv_budget(EngineConfig(kv_cache_memory=gib), torch.device("cuda"), graphs) == gib


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_captured_graphs_replay_the_eager_tokens(checkpoint):
    def run(enforce_eager: bool):
        engine = _engine(checkpoint, dtype="bfloat16", enforce_eager=enforce_eager)
        return engine, _greedy(engine)

    graphed, tokens = run(False)
    assert graphed.info.cuda_graph_sizes == (1, 2, 4, 8)
    assert sum(graphed.runner.graphs.replays.values()) >= 3
    eager, eager_tokens = run(True)
    assert eager.info.cuda_graph_sizes == ()
    assert tokens == eager_tokens
