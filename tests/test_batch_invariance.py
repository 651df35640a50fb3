"""Acceptance 2, 4, 5: seeded determinism, isolation, and memory pressure (real model)."""

from __future__ import annotations

import pytest

from tests.helpers import assert_engine_idle, output_ids, solo_ids
from tests.prompts import varied_prompts
from workers.config import EngineConfig
from workers.engine import LLMEngine


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
def small_pool_engine() -> LLMEngine:
    """A pool of 24 blocks of 16 tokens (384 tokens): far too small for the batches below."""
    return LLMEngine(EngineConfig(device="cpu", num_kv_blocks=24, max_num_batched_tokens=256))


def test_isolation_after_preemption_and_block_reuse(small_pool_engine):
    engine = small_pool_engine
    tok = engine.tokenizer
    secret_a = tok("User A's account number is 4417-1234-5678-9113 and the balance is")["input_ids"]
    secret_b = tok("Dear diary, today the weather in Oslo was cold and")["input_ids"]
    requests = [{"prompt_token_ids": secret_a, "params": {"temperature": 0, "max_tokens": 40}},
                {"prompt_token_ids": secret_b, "params": {"temperature": 0, "max_tokens": 40}}]
    solo = [run_solo(engine, r) for r in requests]
    # pad the batch with long requests so the pool runs out and blocks are reused
    filler = [{"prompt_token_ids": list(range(200, 300)), "params": {"temperature": 0,
              "max_tokens": 30, "ignore_eos": True}} for _ in range(3)]
    together = run_together(engine, filler[:1] + requests[:1] + filler[1:] + requests[1:])
    assert together[1] == solo[0]
    assert together[4] == solo[1]
    assert_engine_idle(engine)


def test_32_requests_under_memory_pressure_match_their_solo_runs(small_pool_engine, prompts):
    engine = small_pool_engine
    requests = []
    for i in range(32):
        params = {"temperature": 0, "max_tokens": 16 + i % 9} if i % 3 else sampled(i, 20)
        requests.append({"prompt_token_ids": prompts[i % len(prompts)], "params": params})
    solo = [run_solo(engine, r) for r in requests]
    preempted_before = _preemptions(engine)
    together = run_together(engine, requests)
    assert _preemptions(engine) > preempted_before, "the pool was not under pressure"
    for i, (a, b) in enumerate(zip(together, solo, strict=True)):
        assert a == b, f"request {i} differs from its solo run"
    assert_engine_idle(engine)


def _preemptions(engine: LLMEngine) -> int:
    return engine.scheduler.num_preemptions
