"""The host tier of the KV cache: demoted cached blocks come back by copy, preempted
requests are swapped out and in instead of recomputed, and outputs never change."""

from __future__ import annotations

import random

import pytest
import torch

from kvserve.workers.core.host_block_pool import HostBlockPool
from kvserve.workers.core.kv_events import KVEvents
from kvserve.workers.engine import LLMEngine
from tests.helpers import assert_engine_idle, solo_ids, solo_ids_each
from tests.test_prefix_caching import (
    check_cache_ledger,
    drive_random_traffic,
    shared_prefix_requests,
)

# -- HostBlockPool units --------------------------------------------------------------------


def test_host_pool_evicts_least_recently_used_cached_block_and_reports_it() -> None:
    events = KVEvents(enabled=True)
    pool = HostBlockPool(2, events)
    a, b = pool.demote(b"a", [1]), pool.demote(b"b", [2])
    assert {a, b} == {0, 1} and pool.num_free == 2  # cached blocks can be evicted
    assert pool.demote(b"a", [1]) is None  # already here: no copy, and now the most recent
    c = pool.demote(b"c", [3])
    assert c == b and list(pool.cached) == [b"a", b"c"]
    assert [(e.kind, e.block_hash) for e in events.drain()] == [
        ("stored", b"a"), ("stored", b"b"), ("removed", b"b"), ("stored", b"c")]


def test_host_pool_confirms_tokens_and_pins_copy_sources() -> None:
    pool = HostBlockPool(2, KVEvents())
    block = pool.demote(b"h", [5, 6])
    assert pool.lookup(b"h", [5, 7]) is None  # same hash, other tokens: a miss
    assert pool.lookup(b"h", [5, 6]) == block
    swapped = pool.take()
    assert pool.take() is None  # the only cached block is pinned by a pending copy
    pool.unpin_all()
    assert pool.take() == block and not pool.cached
    pool.release([swapped, block])
    assert pool.num_free == 2


# -- the engine with a host tier --------------------------------------------------------------


def check_host_ledger(engine: LLMEngine) -> None:
    """Every host block is exactly one of free, cached, or swapped (in one waiting request's
    host table); no copy is pending between steps."""
    host = engine.block_manager.host
    swapped = [b for r in engine.requests.values() for b in r.seq.host_table]
    free, cached = set(host.free_ids), set(host.cached.values())
    assert len(free) == len(host.free_ids) and len(set(swapped)) == len(swapped)
    assert not free & cached and not (free | cached) & set(swapped)
    assert len(free) + len(cached) + len(swapped) == host.num_blocks
    assert not host.pinned and not engine.block_manager.plan


def tiny_engines_with_host_tier(make_tiny_engine) -> tuple[LLMEngine, LLMEngine]:
    """A plain tiny engine (the reference) and one with prefix caching and a host tier, both
    with a device pool of 9 blocks: small enough that 4 shared-prefix requests swap."""
    cfg = {"num_kv_blocks": 9, "block_size": 16, "max_num_seqs": 4, "max_num_batched_tokens": 40}
    return (make_tiny_engine(**cfg),
            make_tiny_engine(**cfg, num_host_kv_blocks=12, enable_prefix_caching=True))


def drive_and_check_every_tier(plain: LLMEngine, engine: LLMEngine, rng: random.Random) -> None:
    """Random traffic of shared-prefix requests on `engine`: every output as `plain` computes
    it alone, both ledgers kept after every step, and every kind of copy between the tiers
    happened (swap out/in of preempted requests, demotion/restore of cached blocks)."""
    requests = shared_prefix_requests(rng, 4)
    expected = {r["request_id"]: solo_ids(plain, **r) for r in requests}

    def check(e: LLMEngine) -> None:
        check_cache_ledger(e)
        check_host_ledger(e)

    drive_random_traffic(engine, requests, expected, rng, check)
    stats = engine.kv_stats()
    assert stats.blocks_swapped_out > 0 and stats.blocks_swapped_in > 0
    assert stats.blocks_offloaded > 0 and stats.blocks_restored > 0, stats
    assert_engine_idle(engine)


@pytest.mark.parametrize("seed", [3, 19, 42])
def test_random_traffic_with_host_tier_keeps_both_ledgers_and_every_output(
    seed, make_tiny_engine, one_torch_thread
):
    plain, engine = tiny_engines_with_host_tier(make_tiny_engine)
    drive_and_check_every_tier(plain, engine, random.Random(seed))


class SlowDMAEvent:
    """A DMA that completes only when someone waits for it: defers every host-tier scatter
    as long as the copier allows."""

    def __init__(self) -> None:
        self.done = True

    def record(self, stream: object = None) -> None:
        self.done = False

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.done = True


@pytest.mark.parametrize(("chunk_blocks", "max_slots", "slow_dma"),
                         [(None, 2, False), (None, 16, True), (1, 4, True)])
def test_cudas_staged_copies_keep_every_output(chunk_blocks, max_slots, slow_dma,
                                               make_tiny_engine,
                                               one_torch_thread):
    """The algorithm the engine runs on CUDA (`KVCopier` staged: chunked, device->host
    scatters deferred to a later step), here with no-op streams and events on CPU."""
    from kvserve.workers.model_executor.kv_transfer import KVCopier

    plain, engine = tiny_engines_with_host_tier(make_tiny_engine)
    runner = engine.runner
    runner.copier = KVCopier(runner.kv_cache, runner.host_kv_cache, staged=True,
                             chunk_blocks=chunk_blocks, max_slots=max_slots)
    if slow_dma:
        new_slot = runner.copier._new_slot

        def slot_with_slow_dma(n: int):
            slot = new_slot(n)
            slot.event = SlowDMAEvent()
            return slot

        runner.copier._new_slot = slot_with_slow_dma
    # the tiny model's tokens barely depend on its KV: check the blocks themselves. Each block
    # copied to the device holds what was last copied into its host block.
    shadow: dict[int, list[torch.Tensor]] = {}
    staged_copy = runner.copier.copy

    def block(b: int) -> list[torch.Tensor]:
        return [t[b].clone() for kv in runner.kv_cache for t in kv]

    def checked_copy(plan) -> None:
        shadow.update({h: block(d) for d, h in plan.to_host})
        staged_copy(plan)
        for h, d in plan.to_device:
            assert all(map(torch.equal, block(d), shadow[h])), (h, d)

    runner.copier.copy = checked_copy
    drive_and_check_every_tier(plain, engine, random.Random(5))
    assert runner.copier.slots  # the staged path ran


# -- the real model ------------------------------------------------------------------------------

GREEDY = {"temperature": 0, "max_tokens": 16, "ignore_eos": True}
TOPICS = ["rivers", "volcanoes", "bridges", "glaciers", "lighthouses", "deserts", "forests",
          "harbours"]


def long_prompt(i: int, sentences: int = 14) -> str:
    topic = TOPICS[i % len(TOPICS)]
    facts = " ".join(f"Fact {j} about {topic} number {i}: it was surveyed in {1900 + 7 * i + j} "
                     f"and measured {13 * j + i} units." for j in range(sentences))
    return f"Report {i}. {facts} Summarise report {i} in one sentence:"


def real_engine_with(checkpoint, **cfg) -> LLMEngine:
    """The real model with other settings, on the session's loaded checkpoint."""
    from kvserve.workers.config import EngineConfig

    return LLMEngine(EngineConfig(device="cpu", **cfg), checkpoint=checkpoint)


def test_host_tier_hits_are_token_identical(real_engine, real_checkpoint):
    """Two conversations take turns on a device pool that holds one history at a time: each
    turn's history was demoted to the host tier by the other's, and comes back by copy."""
    engine = real_engine_with(real_checkpoint, num_kv_blocks=40, num_host_kv_blocks=80,
                              max_num_seqs=1, enable_prefix_caching=True)
    histories = {0: long_prompt(0), 1: long_prompt(1)}
    prompts = {(turn, conv): f"{history} Question {turn}: what is fact {turn}?"
               for turn in range(3) for conv, history in histories.items()}
    expected = dict(zip(prompts, solo_ids_each(real_engine, [
        {"prompt": p, "params": GREEDY} for p in prompts.values()]), strict=True))
    for (turn, conv), prompt in prompts.items():  # in turn order, the two chats alternating
        before = engine.kv_stats()
        got = solo_ids(engine, prompt=prompt, params=GREEDY)
        assert got == expected[turn, conv], (turn, conv)
        after = engine.kv_stats()
        if turn:
            assert after.blocks_restored > before.blocks_restored  # a host-tier hit
            assert after.prefix_hit_tokens - before.prefix_hit_tokens >= 300
    assert engine.kv_stats().blocks_offloaded > 0
    assert_engine_idle(engine)


def test_swap_under_pressure_keeps_16_outputs_identical_to_solo_runs(real_engine,
                                                                    real_checkpoint):
    """The device pool fits a sixth of the working set, the host tier the rest.

    Prompts of ~160 tokens (10+ blocks each) and 32 new tokens: the decodes outgrow the pool
    while earlier requests hold their blocks, so requests are preempted and swapped (on an Intel
    Xeon VM: 11 preemptions, 115 blocks swapped out; 32 requests on a quarter of theirs gave 4
    and 37 at twice the cost). Longer prompts with fewer new tokens (330 and 16) swap only 3
    blocks once, at twice the prefill cost."""
    prompts = [long_prompt(i, sentences=6) for i in range(16)]
    params = {**GREEDY, "max_tokens": 32}
    requests = [{"prompt": p, "params": params, "request_id": f"r{i}"}
                for i, p in enumerate(prompts)]
    lengths = [len(real_engine.tokenizer(p).input_ids) + params["max_tokens"] for p in prompts]
    working_set = sum(-(-n // 16) for n in lengths)
    assert min(lengths) > 190
    engine = real_engine_with(real_checkpoint, num_kv_blocks=working_set // 6,
                              num_host_kv_blocks=working_set - working_set // 6 + 32)
    # the same requests with an ample pool (no preemption): batch-invariant kernels make
    # each equal to its solo run (tests/test_batch_invariance.py), at a fraction of 16 solo runs
    preempted_before = real_engine.kv_stats().preemptions
    expected = {rid: [t for o in outs for t in o.token_ids]
                for rid, outs in real_engine.generate_all(requests).items()}
    assert real_engine.kv_stats().preemptions == preempted_before  # the reference ran unpressed
    outputs = engine.generate_all(requests)
    assert {rid: [t for o in outs for t in o.token_ids] for rid, outs in outputs.items()} \
        == expected
    stats = engine.kv_stats()
    assert stats.preemptions > 1 and stats.blocks_swapped_out > 10
    assert stats.blocks_swapped_in == stats.blocks_swapped_out
    assert stats.swap_bytes > 0 and stats.swap_seconds > 0
    assert_engine_idle(engine)
