"""Acceptance 2, 4, 5: seeded determinism, isolation, and memory pressure (real model)."""

from __future__ import annotations

import math

import pytest

from kvserve.workers.config import EngineConfig
from kvserve.workers.core.outputs import RequestOutput
from kvserve.workers.engine import LLMEngine
from tests.helpers import assert_engine_idle, output_ids, solo_ids, solo_ids_each
from tests.prompts import varied_prompts

pytestmark = pytest.mark.slow  # every test here runs the real SmolLM2


def run_solo(engine: LLMEngine, request: dict) -> list[int]:
    return solo_ids(engine, **request)


def run_together(engine: LLMEngine, requests: list[dict]) -> list[list[int]]:
    results = engine.generate_all(requests)
    return [output_ids(outs) for outs in results.values()]  # insertion order = request order


def sampled(seed: int, max_tokens: int = 24, **extra) -> dict:
    return {"temperature": 0.8, "top_p": 0.95, "top_k": 50, "seed": seed,
            "max_tokens": max_tokens, **extra}


@pytest.fixture(scope="module")
def prompts(real_engine) -> list[list[int]]:
    short = [ids for name, ids in varied_prompts(real_engine.tokenizer).items()
             if name != "long_1500"]
    return short


def test_seeded_request_is_identical_alone_and_in_a_batch_of_16(real_engine, prompts):
    target = {"prompt_token_ids": prompts[2], "params": sampled(seed=1234, max_tokens=32)}
    alone = run_solo(real_engine, target)
    others = [{"prompt_token_ids": prompts[i % len(prompts)],
               "params": sampled(seed=i, repetition_penalty=1.1) if i % 2 else {
                   "temperature": 0, "max_tokens": 20 + i}} for i in range(15)]
    batch = run_together(real_engine, others[:7] + [target] + others[7:])
    assert batch[7] == alone
    assert run_solo(real_engine, target) == alone  # and again, alone
    different_seed = run_solo(real_engine, {**target, "params": sampled(seed=99, max_tokens=32)})
    assert different_seed != alone  # the seed matters: the comparison above is not vacuous
    assert_engine_idle(real_engine)


@pytest.fixture(scope="module")
def small_pool_engine(real_checkpoint) -> LLMEngine:
    """A pool of 24 blocks of 16 tokens (384 tokens): far too small for the batches below."""
    return LLMEngine(EngineConfig(device="cpu", num_kv_blocks=24, max_num_batched_tokens=256),
                     checkpoint=real_checkpoint)


@pytest.fixture(scope="module")
def small_pool_speculative_engine(real_checkpoint) -> LLMEngine:
    """The same small pool, with prompt-lookup speculation: rejected drafts write K/V into
    slots (and blocks) that are given back and reused by other requests."""
    return LLMEngine(EngineConfig(device="cpu", num_kv_blocks=24, max_num_batched_tokens=256,
                                  speculative_method="ngram", prompt_lookup_min=1),
                     checkpoint=real_checkpoint)


@pytest.mark.parametrize("engine_name", ["small_pool_engine", "small_pool_speculative_engine"])
def test_isolation_after_preemption_and_block_reuse(engine_name, request, small_pool_engine):
    """Two private prompts, run among long fillers in a pool too small for all of them, answer
    exactly as they do alone. The claim needs the pressure to be real, so it is asserted: the
    engine preempted (its public KV stats) and some KV block served two requests (pigeonhole on
    the requests' own token counts). Negative control: with `num_kv_blocks=200` both pressure
    asserts fail (checked by hand), so the output comparison is not vacuous. With speculation
    the solo answers are the plain engine's, and drafts must have been rejected (their K/V
    written to slots that other requests' blocks then reuse)."""
    engine: LLMEngine = request.getfixturevalue(engine_name)
    tok = engine.tokenizer
    secret_a = tok("User A's account number is 4417-1234-5678-9113 and the balance is")["input_ids"]
    secret_b = tok("Dear diary, today the weather in Oslo was cold and")["input_ids"]
    requests = [{"prompt_token_ids": secret_a, "params": {"temperature": 0, "max_tokens": 40}},
                {"prompt_token_ids": secret_b, "params": {"temperature": 0, "max_tokens": 40}}]
    solo = [run_solo(small_pool_engine, r) for r in requests]
    rejected_before = engine.spec_stats.num_draft_tokens - engine.spec_stats.num_accepted_tokens
    # pad the batch with long requests so the pool runs out and blocks are reused
    filler = [{"prompt_token_ids": list(range(200, 300)), "params": {"temperature": 0,
              "max_tokens": 30, "ignore_eos": True}} for _ in range(3)]
    preempted_before = engine.kv_stats().preemptions
    results = list(engine.generate_all(filler[:1] + requests[:1] + filler[1:] + requests[1:])
                   .values())
    assert engine.kv_stats().preemptions > preempted_before, "no request was preempted"
    assert sum(blocks_held(engine, outs) for outs in results) > engine.kv_stats().device_blocks, \
        "the requests fit the pool side by side: no block was reused"
    together = [output_ids(outs) for outs in results]
    assert together[1] == solo[0]
    assert together[4] == solo[1]
    assert_engine_idle(engine)
    if engine.proposer is not None:
        stats = engine.spec_stats
        assert stats.num_draft_tokens - stats.num_accepted_tokens > rejected_before


def blocks_held(engine: LLMEngine, outputs: list[RequestOutput]) -> int:
    """The KV blocks a finished request held at its last step: every token but the last one
    sampled has its keys cached. With prefix caching off (this engine's default) no block is
    shared, so if these add up to more than the pool, some block served two requests."""
    assert not engine.config.enable_prefix_caching
    usage = outputs[-1].usage
    assert usage is not None
    tokens = usage.prompt_tokens + usage.completion_tokens - 1
    return math.ceil(tokens / engine.info.block_size)


def test_32_requests_under_memory_pressure_match_their_solo_runs(small_pool_engine, prompts,
                                                                real_engine):
    """Preemption changes no token: 32 greedy and seeded requests in a pool too small for
    them give what each gives alone. The solo outputs come from one batch on the big pool,
    where nothing is preempted (each request in a batch equals its solo run:
    test_seeded_request_is_identical_alone_and_in_a_batch_of_16)."""
    engine = small_pool_engine
    requests = []
    for i in range(32):
        params = {"temperature": 0, "max_tokens": 16 + i % 9} if i % 3 else sampled(i, 20)
        requests.append({"prompt_token_ids": prompts[i % len(prompts)], "params": params})
    big_pool_preemptions = real_engine.kv_stats().preemptions
    solo = solo_ids_each(real_engine, requests)
    assert real_engine.kv_stats().preemptions == big_pool_preemptions
    preempted_before = engine.kv_stats().preemptions
    together = run_together(engine, requests)
    assert engine.kv_stats().preemptions > preempted_before, "the pool was not under pressure"
    for i, (a, b) in enumerate(zip(together, solo, strict=True)):
        assert a == b, f"request {i} differs from its solo run"
    assert_engine_idle(engine)
