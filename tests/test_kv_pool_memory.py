"""What an engine commits to memory: a CPU KV pool's pages only as its blocks are first written,
freed blocks reused before new ones, and weights that are the checkpoint file's own pages.

Why it matters: committing (writing) memory is a page fault per 4 KiB page, which on the CI's VM
cost ~2.5 s per GiB; a 1 GiB pool zeroed up front took 4-8 CPU-s of each engine's and replica's
start, for blocks most runs never use.
"""

from __future__ import annotations

import ctypes
import mmap
import random

import pytest
import torch

from kvserve.workers.builder import materialize
from kvserve.workers.config import EngineConfig
from kvserve.workers.core.block_manager import BlockManager
from kvserve.workers.engine import LLMEngine
from kvserve.workers.model_executor.kv_cache import KVCacheSpec, allocate_kv_cache
from kvserve.workers.model_executor.model import CausalLM
from kvserve.workers.model_executor.tiny import tiny_checkpoint

MiB = 1024**2
# SmolLM2-135M's KV shape: 30 layers, 3 KV heads of 64
SPEC = KVCacheSpec(num_layers=30, num_kv_heads=3, head_dim=64, block_size=16,
                   dtype=torch.float32)


def resident_bytes(tensor: torch.Tensor) -> int:
    """Bytes of `tensor`'s pages in RAM (mincore(2) on its own address range: unlike the
    process's RSS, nothing else the process does moves it)."""
    page = mmap.PAGESIZE
    start = tensor.data_ptr() // page * page
    end = -(-(tensor.data_ptr() + tensor.nbytes) // page) * page
    vec = (ctypes.c_ubyte * ((end - start) // page))()
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    assert libc.mincore(ctypes.c_void_p(start), ctypes.c_size_t(end - start), vec) == 0
    return sum(b & 1 for b in vec) * page


def pool_resident_bytes(cache) -> int:
    return sum(resident_bytes(t) for kv in cache for t in kv)


def test_a_cpu_pool_reads_as_zeros_and_commits_only_the_blocks_written():
    num_blocks = SPEC.num_blocks_for(256 * MiB)
    cache = allocate_kv_cache(SPEC, num_blocks, torch.device("cpu"))
    assert pool_resident_bytes(cache) == 0  # nothing committed yet
    assert all(k.shape == (num_blocks, 16, 3, 64) and k.is_contiguous() and v.is_contiguous()
               for k, v in cache)
    # every layer's K and V are separate memory (views of one mapping, never overlapping)
    starts = sorted(t.data_ptr() for kv in cache for t in kv)
    assert all(b - a >= cache[0][0].nbytes for a, b in zip(starts, starts[1:], strict=False))
    for k, v in cache:
        k[:8].fill_(1.0)  # the first 8 blocks of every K and V written
        v[:8].fill_(2.0)
    block = cache[0][0][0].nbytes  # 16 tokens x 3 heads x 64 x 4 B = 12 KiB, three pages
    assert pool_resident_bytes(cache) == 2 * SPEC.num_layers * 8 * block
    # the rest reads as zeros (an unwritten page reads the kernel's one zero page)
    assert float(cache[5][0][7].mean()) == 1.0 and not cache[5][0][8].any()
    assert all(not k[[8, num_blocks // 2, -1]].any() and not v[[8, -1]].any() for k, v in cache)
    # the control: torch.zeros, as the pool was allocated before, commits all of it at once
    eager = torch.zeros(num_blocks * SPEC.bytes_per_block // 4)
    assert resident_bytes(eager) > 0.99 * eager.nbytes


def test_the_block_freed_last_is_taken_first_so_the_pool_touched_is_the_peak_use():
    """Random allocate/free traffic on a 400-block pool whose live use peaks far below it: the
    blocks ever taken are exactly the peak (a FIFO free list walks the whole pool)."""
    rng = random.Random(7)
    bm = BlockManager(num_blocks=400, block_size=4)
    tables: list[list[int]] = []
    peak = 0
    for _ in range(600):
        if tables and (len(tables) > 6 or rng.random() < 0.45):
            bm.deallocate(tables.pop(rng.randrange(len(tables))))
        else:
            table: list[int] = []
            bm.allocate(table, rng.randint(1, 40))
            tables.append(table)
        peak = max(peak, bm.num_blocks - bm.num_free)
        assert all(b < bm.free_ids.num_touched for t in tables for b in t)
    assert peak < 100 and bm.free_ids.num_touched == peak
    assert bm.stats().device_touched == peak


def test_an_engines_load_counts_the_pool_pages_it_wrote(make_tiny_engine):
    """The KV pool's share of the engine's RSS (what a soak takes out of the RSS it watches) is
    its touched blocks, and those are the peak of blocks held at once."""
    engine: LLMEngine = make_tiny_engine(num_kv_blocks=500, max_num_seqs=4)
    assert engine.load().kv_pool_ram_bytes == 0
    peak = 0
    for wave in range(3):
        for i in range(4):
            engine.add_request(prompt_token_ids=list(range(3, 40 + 10 * i)),
                               params={"max_tokens": 8, "temperature": 0.0},
                               request_id=f"w{wave}-{i}")
        while engine.has_unfinished():
            engine.step()
            peak = max(peak, engine.kv_stats().device_used)
    stats = engine.kv_stats()
    assert 0 < stats.device_touched == peak < 500
    assert engine.load().kv_pool_ram_bytes == peak * engine.bytes_per_block


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_weights_already_in_the_models_dtype_are_the_checkpoints_own_tensors(dtype):
    """No copy of a weight the model can use as it is (the loader's are read-only views of the
    safetensors file's page cache); a weight in another dtype is converted; a tied lm_head stays
    the embedding; fused projections are new tensors."""
    ckpt = tiny_checkpoint()
    tensors = dict(ckpt.tensors)
    with torch.device("meta"):
        model = CausalLM(ckpt.config)
    model = materialize(model, torch.device("cpu"), dtype)  # as build_model does
    model.load_checkpoint(dict(tensors))
    embed, norm = tensors["model.embed_tokens.weight"], tensors["model.norm.weight"]
    shared = dtype == torch.float32  # the tiny checkpoint is fp32
    assert (model.embed_tokens.weight.data_ptr() == embed.data_ptr()) is shared
    assert (model.norm.weight.data_ptr() == norm.data_ptr()) is shared
    assert torch.equal(model.embed_tokens.weight, embed.to(dtype))
    assert model.lm_head.weight is model.embed_tokens.weight
    qkv = model.layers[0].self_attn.qkv_proj.weight
    assert torch.equal(qkv, torch.cat([tensors[f"model.layers.0.self_attn.{p}_proj.weight"]
                                       for p in "qkv"]).to(dtype))


def test_the_real_engine_shares_its_plain_weights_with_the_checkpoint(real_engine,
                                                                      real_checkpoint):
    for name in ("model.norm.weight", "model.embed_tokens.weight",
                 "model.layers.0.input_layernorm.weight"):
        ours = real_engine.model.get_parameter(name.removeprefix("model."))
        assert ours.data_ptr() == real_checkpoint.tensors[name].data_ptr(), name


def test_an_engine_on_a_large_cpu_pool_commits_only_the_blocks_it_used(real_checkpoint):
    """A 1 GiB pool, a few requests: the pool's pages in RAM are the touched blocks, which is
    what the engine's load reports (and a soak takes out of the RSS it watches)."""
    engine = LLMEngine(EngineConfig(kv_cache_memory=1024**3, device="cpu"),
                       checkpoint=real_checkpoint)
    assert engine.kv_stats().device_blocks * engine.bytes_per_block > 1000 * MiB
    engine.generate_all([{"prompt": f"Count to {n}.", "params": {"max_tokens": 4}}
                         for n in range(3)])
    touched = engine.kv_stats().device_touched
    assert 0 < touched < 20
    resident = pool_resident_bytes(engine.runner.kv_cache)
    reported = engine.load().kv_pool_ram_bytes
    assert reported == touched * engine.bytes_per_block
    # the touched blocks' pages (a block taken for a slot never written holds none), nothing
    # beyond them but a page at each of the 60 tensors' edges
    assert reported // 2 < resident <= reported + 60 * mmap.PAGESIZE, (resident, reported)
