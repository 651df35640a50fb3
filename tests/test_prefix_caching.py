"""Prefix caching: reused KV blocks give token-identical outputs, tenants
(cache_salt) never share blocks, and every block of an ended request is free or cached."""

from __future__ import annotations

import pytest

from kvserve.workers.config import EngineConfig
from kvserve.workers.engine import LLMEngine
from tests.helpers import assert_engine_idle, output_ids, solo_ids, solo_ids_each

SYSTEM = ("You are a meticulous assistant for a logistics company. Answer briefly, cite the "
          "relevant rule number, and never invent data. Rules: 1. Parcels over 30 kg ship as "
          "freight. 2. Refunds need a receipt. 3. Weekend deliveries cost extra. 4. Addresses "
          "must include a postcode. 5. Fragile goods need double boxing.")
QUESTIONS = ["Can I ship a 35 kg parcel?", "How do I get a refund?",
             "Do you deliver on Sundays?", "How should I pack glasses?"]
GREEDY = {"temperature": 0, "max_tokens": 24}


@pytest.fixture(scope="module")
def cached_engine(model_dir) -> LLMEngine:
    return LLMEngine(EngineConfig(kv_cache_memory=256 * 1024**2, device="cpu",
                                  enable_prefix_caching=True))


def chat(question: str, history: tuple = ()) -> list[dict[str, str]]:
    return [{"role": "system", "content": SYSTEM}, *history, {"role": "user", "content": question}]


def hits(engine: LLMEngine) -> int:
    return engine.kv_stats().prefix_hit_tokens


def test_shared_prefix_batch_is_token_identical_and_hits(cached_engine, real_engine):
    expected = solo_ids_each(real_engine, [{"messages": chat(q), "params": GREEDY}
                                           for q in QUESTIONS])
    assert solo_ids(cached_engine, messages=chat(QUESTIONS[0]), params=GREEDY) == expected[0]
    before = hits(cached_engine)
    outs = cached_engine.generate_all([{"messages": chat(q), "params": GREEDY}
                                       for q in QUESTIONS])
    assert [output_ids(o) for o in outs.values()] == expected
    assert hits(cached_engine) - before >= 4 * 64  # the system prompt's blocks, every request
    assert_engine_idle(cached_engine)  # ended requests' blocks are free or cached


def test_multi_turn_chat_reuses_its_history_exactly(cached_engine, real_engine):
    history: tuple = ()
    for turn, question in enumerate(QUESTIONS[:3]):
        messages = chat(question, history)
        expected = solo_ids(real_engine, messages=messages, params=GREEDY)
        before = hits(cached_engine)
        got = solo_ids(cached_engine, messages=messages, params=GREEDY)
        assert got == expected
        if turn:
            assert hits(cached_engine) - before >= 64
        answer = real_engine.tokenizer.decode(got, skip_special_tokens=True)
        history = (*history, {"role": "user", "content": question},
                   {"role": "assistant", "content": answer})
    assert_engine_idle(cached_engine)


def test_tenants_never_hit_each_others_blocks(cached_engine):
    prompt = SYSTEM + " Tenant question: what is rule 3?"
    request = {"prompt": prompt, "params": GREEDY}
    first = solo_ids(cached_engine, cache_salt="tenant-a", **request)
    before = hits(cached_engine)
    assert solo_ids(cached_engine, cache_salt="tenant-b", **request) == first
    assert hits(cached_engine) == before  # same prompt, other tenant: nothing shared
    assert solo_ids(cached_engine, cache_salt="tenant-a", **request) == first
    assert hits(cached_engine) > before  # same tenant: the prefix is reused
    assert_engine_idle(cached_engine)


def test_eviction_under_a_small_pool_stays_exact(make_tiny_engine, one_torch_thread):
    prompts = [[(7 * i + j) % 400 + 3 for j in range(70)] for i in range(6)]
    requests = [{"prompt_token_ids": p,
                 "params": {"max_tokens": 20, "ignore_eos": True, "temperature": 0}}
                for p in prompts + prompts[::-1]]  # the pool keeps only the most recent prefixes
    cfg = {"num_kv_blocks": 24, "block_size": 16, "max_num_seqs": 2}
    plain, cached = make_tiny_engine(**cfg), make_tiny_engine(**cfg, enable_prefix_caching=True)
    expected = [solo_ids(plain, **r) for r in requests]
    assert [solo_ids(cached, **r) for r in requests] == expected
    assert hits(cached) > 0 and cached.block_manager.num_evicted > 0
    assert_engine_idle(cached)


def check_cache_ledger(engine: LLMEngine) -> None:
    """Each block is exactly one of free, cached (unreferenced, hashed) or owned, and an owned
    block's ref_count is the number of live sequences whose tables hold it."""
    bm = engine.block_manager
    owners: dict[int, int] = {}
    for req in engine.requests.values():
        for block_id in req.seq.block_table:
            owners[block_id] = owners.get(block_id, 0) + 1
    free, cached = set(bm.free_ids), set(bm.cached)
    assert len(free) == len(bm.free_ids) and not free & cached
    assert not (free | cached) & set(owners)
    assert len(free) + len(cached) + len(owners) == bm.num_blocks
    for block in bm.blocks:
        assert block.ref_count == owners.get(block.block_id, 0), block
    for block_id in cached:
        assert bm.by_hash[bm.blocks[block_id].block_hash] == block_id
    for block_hash, block_id in bm.by_hash.items():
        assert bm.blocks[block_id].block_hash == block_hash


def shared_prefix_requests(rng, num_prefixes: int) -> list[dict]:
    """40 greedy requests over a few shared prompt prefixes, seeded."""
    prefixes = [[rng.randrange(3, 400) for _ in range(rng.choice([16, 33, 48]))]
                for _ in range(num_prefixes)]
    return [{"prompt_token_ids": rng.choice(prefixes) + [rng.randrange(3, 400)
                                                         for _ in range(rng.randrange(1, 12))],
             "params": {"max_tokens": rng.randrange(1, 24), "temperature": 0,
                        "ignore_eos": True},
             "request_id": f"r{i}"} for i in range(40)]


def drive_random_traffic(engine: LLMEngine, requests: list[dict], expected: dict[str, list[int]],
                         rng, check) -> None:
    """Add requests a few per step, abort some at random, `check(engine)` after every step;
    then every request that was not aborted must have produced `expected[id]` (its solo run):
    nobody got another request's tokens."""
    got: dict[str, list[int]] = {}
    pending, aborted = list(requests), set()
    while pending or engine.has_unfinished():
        for _ in range(rng.randrange(0, 3)):
            if pending:
                engine.add_request(**pending.pop(0))
        if engine.requests and rng.random() < 0.05:
            victim = rng.choice(sorted(engine.requests))
            engine.abort(victim)
            aborted.add(victim)
        for out in engine.step():
            got.setdefault(out.request_id, []).extend(out.token_ids)
        check(engine)
    for rid, ids in got.items():
        if rid not in aborted:
            assert ids == expected[rid], rid


@pytest.mark.parametrize("seed", [7, 11, 23, 42])
def test_random_shared_prefix_traffic_keeps_the_ledger_and_every_output(
    seed, make_tiny_engine, one_torch_thread
):
    import random

    rng = random.Random(seed)
    requests = shared_prefix_requests(rng, 3)
    cfg = {"num_kv_blocks": 9, "block_size": 16, "max_num_seqs": 4, "max_num_batched_tokens": 40}
    plain, cached = make_tiny_engine(**cfg), make_tiny_engine(**cfg, enable_prefix_caching=True)
    expected = {r["request_id"]: solo_ids(plain, **r) for r in requests}
    drive_random_traffic(cached, requests, expected, rng, check_cache_ledger)
    assert hits(cached) > 0 and cached.scheduler.num_preemptions > 0
    assert_engine_idle(cached)


def test_the_kv_reporter_reports_what_the_engine_holds(make_tiny_engine, one_torch_thread):
    """The cluster's KV reporter reads the engine only through its public surface
    (`cached_block_hashes`, `request_blocks`, the KV events): a live request's blocks and the
    full blocks its prompt filled are in the report, and nothing of it once it finished."""
    from kvserve.cluster.kv_reporter import KVReporter

    engine = make_tiny_engine(enable_prefix_caching=True, block_size=4, num_kv_blocks=32)
    reporter = KVReporter(engine, manager=None, replica_id="r")  # no manager: never sends
    engine.add_request(prompt_token_ids=list(range(10, 30)), request_id="a",
                       params={"max_tokens": 3, "temperature": 0, "ignore_eos": True})
    engine.step()  # the 20-token prompt: 5 blocks held, all full, so all cached
    state = reporter.state()
    assert state.requests == {"a": 5}
    assert len(state.device) == 5 and state.host == []
    delta = reporter._delta_report(engine.kv_events.drain())
    assert sorted(delta.stored["device"]) == sorted(state.device)
    for _ in engine.run_until_done():
        pass
    state = reporter.state()
    assert state.requests == {} and len(state.device) >= 5  # still cached for later hits
    assert_engine_idle(engine)
