"""What an engine commits to memory: a CPU KV pool's pages only as its blocks are first written,
freed blocks reused before new ones, and weights that are the checkpoint file's own pages.

Why it matters: committing (writing) memory is a page fault per 4 KiB page, which on the CI's VM
cost ~2.5 s per GiB; a 1 GiB pool zeroed up front took 4-8 CPU-s of each engine's and replica's
start, for blocks most runs never use.
"""

from __future__ import annotations

import random

import psutil
import pytest
import torch

from workers.config import EngineConfig
from workers.core.block_manager import BlockManager
from workers.engine import LLMEngine
from workers.model_executor.kv_cache import KVCacheSpec, allocate_kv_cache
from workers.model_executor.model import CausalLM
from workers.model_executor.tiny import tiny_checkpoint

MiB = 1024**2
# SmolLM2-135M's KV shape: 30 layers, 3 KV heads of 64
SPEC = KVCacheSpec(num_layers=30, num_kv_heads=3, head_dim=64, block_size=16,
                   dtype=torch.float32)


def rss() -> int:
    return psutil.Process().memory_info().rss


def test_a_cpu_pool_reads_as_zeros_and_commits_only_the_blocks_written():
    num_blocks = SPEC.num_blocks_for(256 * MiB)
    before = rss()
    cache = allocate_kv_cache(SPEC, num_blocks, torch.device("cpu"))
    assert rss() - before < 16 * MiB  # nothing committed yet
    assert all(k.shape == (num_blocks, 16, 3, 64) and k.is_contiguous() and v.is_contiguous()
               for k, v in cache)
    # every layer's K and V are separate memory (views of one mapping, never overlapping)
    starts = sorted(t.data_ptr() for kv in cache for t in kv)
    assert all(b - a >= cache[0][0].nbytes for a, b in zip(starts, starts[1:], strict=False))
    for k, v in cache:
        assert not k[[0, num_blocks // 2, -1]].any() and not v[[0, -1]].any()  # zeros
        k[:8].fill_(1.0)  # the first 8 blocks of each K written: ~30 x 8 x 12 KiB
        v[:8].fill_(2.0)
    written = rss() - before
    assert 4 * MiB < written < 32 * MiB, written / MiB
    assert float(cache[5][0][7].mean()) == 1.0 and not cache[5][0][8].any()
    # the control: torch.zeros, as the pool was allocated before, commits all of it at once
    before = rss()
    eager = torch.zeros(num_blocks * SPEC.bytes_per_block // 4)
    assert rss() - before > 200 * MiB
    del eager


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
        assert all(b < bm.num_touched for t in tables for b in t)
    assert peak < 100 and bm.num_touched == peak
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
    model = model.to_empty(device="cpu").to(dtype)
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


def anonymous_rss() -> int:
    """Resident memory of this process's own (not file-backed) pages: the checkpoint's pages
    that packing reads are the page cache's, shared with every process that maps the file."""
    with open("/proc/self/status") as status:
        line = next(x for x in status if x.startswith("RssAnon:"))
    return int(line.split()[1]) * 1024


def test_an_engine_on_a_large_cpu_pool_starts_without_committing_it(real_checkpoint):
    before = anonymous_rss()
    engine = LLMEngine(EngineConfig(kv_cache_memory=1024**3, device="cpu"),
                       checkpoint=real_checkpoint)
    grown = anonymous_rss() - before
    pool = engine.kv_stats().device_blocks * engine.bytes_per_block
    assert pool > 1000 * MiB
    # its packed projections (~540 MB in fp32) and the warm-up's buffers (~625 MiB in all on
    # 12-04); a pool zeroed at start would add all of its 1 GiB
    assert grown < 0.7 * pool, grown / MiB
