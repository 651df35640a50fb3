"""KV block accounting under random traffic: a stateful property test of the real engine.

The property test drives `LLMEngine` (tiny random model, a pool of 16 blocks of 4 tokens) through
random interleavings of add / step / abort / run-to-completion, and after every action checks the
block ledger against the live sequences: every block is either free (ref_count 0, in the free
list once) or owned by exactly one live sequence (ref_count 1), nothing leaks, and every block
table covers the sequence's computed tokens. The pool is small enough that preemption happens.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    invariant,
    multiple,
    precondition,
    rule,
    run_state_machine_as_test,
)

from kvserve.bench.exactness import hf_greedy
from kvserve.workers.config import EngineConfig
from kvserve.workers.core.block_manager import NO_BLOCK, held
from kvserve.workers.core.outputs import RequestOutput
from kvserve.workers.core.scheduler import Scheduler
from kvserve.workers.core.sequence import Sequence, SequenceStatus
from kvserve.workers.engine import LLMEngine
from kvserve.workers.model_executor.kv_cache import KVCacheSpec
from kvserve.workers.model_executor.loader import LoadedCheckpoint
from kvserve.workers.model_executor.tiny import tiny_checkpoint, tiny_config
from tests.helpers import assert_engine_idle, output_ids

pytestmark = pytest.mark.usefixtures("one_torch_thread")

BLOCK_SIZE = 4
NUM_BLOCKS = 16  # a 30-token prompt + 20 new tokens needs 13: fits alone, not with company
MAX_PROMPT = 30
MAX_NEW = 20
MAX_STEPS_TO_DRAIN = 3000  # far above what any example needs; more means a livelock

# -- invariants over the engine -----------------------------------------------------------------


def check_block_ledger(engine: LLMEngine) -> None:
    """Every block is free or owned by exactly one live sequence; tables cover computed tokens.
    With a sliding window, the places a table freed are a run from its start, behind the
    window, and a sequence holds no more than `blocks_at_most` says."""
    bm = engine.block_manager
    sched: Scheduler = engine.scheduler
    live: list[Sequence] = [r.seq for r in engine.requests.values()]

    free = list(bm.free_ids)
    assert len(free) == len(set(free)), f"a block is in the free list twice: {free}"
    owner: dict[int, str] = {}
    for seq in live:
        assert not seq.is_finished, f"{seq.request_id} is finished but still in engine.requests"
        gone = seq.block_table.count(NO_BLOCK)
        assert seq.block_table[:gone] == [NO_BLOCK] * gone, seq.block_table
        assert gone <= bm.window_start(seq.num_computed_tokens), (seq.block_table,
                                                                  seq.num_computed_tokens)
        assert held(seq.block_table) <= bm.blocks_at_most(
            seq.num_prompt_tokens + seq.params.max_tokens), seq.block_table
        for b in seq.block_table[gone:]:
            assert b not in owner, f"block {b} owned by {owner[b]} and {seq.request_id}"
            owner[b] = seq.request_id
        assert len(seq.block_table) * bm.block_size >= seq.num_computed_tokens, (
            f"{seq.request_id}: {len(seq.block_table)} blocks for "
            f"{seq.num_computed_tokens} computed tokens"
        )
        assert 0 <= seq.num_computed_tokens <= seq.num_tokens
        # ...and no more: between steps a table holds exactly its computed tokens' blocks (the
        # slots of rejected speculative drafts, and a block only they used, were given back)
        assert len(seq.block_table) == bm.blocks_for(seq.num_computed_tokens), (
            f"{seq.request_id}: {len(seq.block_table)} blocks for {seq.num_computed_tokens} "
            "computed tokens (a block held beyond them)")
    assert not set(owner) & set(free), f"owned blocks in the free list: {set(owner) & set(free)}"
    assert len(owner) + len(free) == bm.num_blocks, (
        f"leak: {len(owner)} owned + {len(free)} free != {bm.num_blocks}"
    )
    for block in bm.blocks:
        expected = 1 if block.block_id in owner else 0
        assert block.ref_count == expected, (
            f"block {block.block_id}: ref_count {block.ref_count}, expected {expected}"
        )

    # the scheduler's queues hold exactly the live sequences, each once, in the right state
    running, waiting = list(sched.running), list(sched.waiting)
    assert len({id(s) for s in running + waiting}) == len(running) + len(waiting)
    assert {id(s) for s in running + waiting} == {id(s) for s in live}
    assert len(running) <= engine.config.max_num_seqs
    for seq in running:
        assert seq.status is SequenceStatus.RUNNING
    for seq in waiting:
        assert seq.status is SequenceStatus.WAITING
        assert seq.block_table == [], f"waiting {seq.request_id} holds {seq.block_table}"
        assert seq.num_computed_tokens == 0


def pool_bytes(num_blocks: int) -> int:
    """kv_cache_memory for exactly `num_blocks` blocks of BLOCK_SIZE tokens of the tiny model."""
    cfg = tiny_config("llama")
    spec = KVCacheSpec(
        cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, BLOCK_SIZE, torch.float32
    )
    return num_blocks * spec.bytes_per_block


# -- the stateful property test -----------------------------------------------------------------


@dataclass
class RunStats:
    examples: int = 0
    requests: int = 0
    preempted_requests: int = 0
    aborted_live: int = 0
    finish_reasons: Counter = field(default_factory=Counter)
    draft_tokens: int = 0  # with speculation: drafts verified, and of them accepted
    accepted_tokens: int = 0
    multi_token_outputs: int = 0  # outputs that carried more than one token


@st.composite
def request_specs(draw: st.DrawFn) -> dict[str, Any]:
    prompt = draw(st.lists(st.integers(0, 49151), min_size=1, max_size=MAX_PROMPT))
    params: dict[str, Any] = {
        "max_tokens": draw(st.integers(1, MAX_NEW)),
        "ignore_eos": draw(st.booleans()),
    }
    mode = draw(st.sampled_from(["greedy", "seeded", "seeded_truncated"]))
    if mode == "greedy":
        params["temperature"] = 0.0
    else:
        params["temperature"] = draw(st.sampled_from([0.7, 1.0, 1.5]))
        params["seed"] = draw(st.integers(0, 2**32))
        if mode == "seeded_truncated":
            params["top_k"] = draw(st.sampled_from([0, 5, 50]))
            params["top_p"] = draw(st.sampled_from([0.5, 0.9, 1.0]))
    if draw(st.booleans()):
        # a stop token id that the model is likely to emit sometimes: one from the prompt
        params["stop_token_ids"] = [draw(st.sampled_from(prompt))]
    return {"prompt_token_ids": prompt, "params": params}


class EngineMachine(RuleBasedStateMachine):
    ids = Bundle("ids")

    def __init__(self, engine: LLMEngine, stats: RunStats) -> None:
        super().__init__()
        self.engine = engine
        self.stats = stats
        stats.examples += 1
        self.counter = 0
        self.live: dict[str, Sequence] = {}
        self.ended: set[str] = set()
        self.seqs: dict[str, Sequence] = {}
        self.streamed: dict[str, list[RequestOutput]] = {}

    # -- actions ------------------------------------------------------------------------------
    def _add(self, spec: dict[str, Any]) -> str:
        self.counter += 1
        rid = f"req{self.counter}"
        got = self.engine.add_request(request_id=rid, **spec)
        assert got == rid
        seq = self.engine.requests[rid].seq
        self.live[rid] = seq
        self.seqs[rid] = seq
        self.streamed[rid] = []
        self.stats.requests += 1
        return rid

    @rule(target=ids, spec=request_specs())
    def add(self, spec: dict[str, Any]) -> str:
        return self._add(spec)

    @rule(target=ids, specs=st.lists(request_specs(), min_size=2, max_size=5))
    def add_burst(self, specs: list[dict[str, Any]]) -> Any:
        return multiple(*[self._add(s) for s in specs])

    @rule()
    def step(self) -> None:
        self._step()

    @rule(n=st.integers(2, 8))
    def step_many(self, n: int) -> None:
        for _ in range(n):
            self._step()
            check_block_ledger(self.engine)

    @rule(rid=st.one_of(ids, st.sampled_from(["never-added", ""])))
    def abort(self, rid: str) -> None:
        out = self.engine.abort(rid)
        if rid in self.live:
            assert out is not None, f"abort({rid!r}) of a live request returned None"
            assert out.request_id == rid and out.finish_reason == "abort"
            assert out.token_ids == []
            self._record(out)
            self.stats.aborted_live += 1
        else:
            assert out is None, f"abort({rid!r}) of an unknown/ended request returned {out}"
        assert rid not in self.engine.requests

    @precondition(lambda self: bool(self.live))
    @rule(data=st.data())
    def abort_live(self, data: st.DataObject) -> None:
        self.abort(data.draw(st.sampled_from(sorted(self.live)), label="live id"))

    @rule()
    def run_to_completion(self) -> None:
        self._drain()

    # -- helpers ------------------------------------------------------------------------------
    def _step(self) -> list[RequestOutput]:
        outs = self.engine.step()
        seen: set[str] = set()
        for out in outs:
            assert out.request_id not in seen, f"two outputs for {out.request_id} in one step"
            seen.add(out.request_id)
            assert out.request_id in self.live, f"output for non-live {out.request_id}"
            k = self.engine.config.num_speculative_tokens if self.engine.proposer else 0
            assert 1 <= len(out.token_ids) <= 1 + k
            self.stats.multi_token_outputs += len(out.token_ids) > 1
            self._record(out)
        return outs

    def _record(self, out: RequestOutput) -> None:
        rid = out.request_id
        self.streamed[rid].append(out)
        seq = self.seqs[rid]
        params = seq.params
        n_out = len(output_ids(self.streamed[rid]))
        assert n_out <= params.max_tokens
        assert output_ids(self.streamed[rid]) == seq.output_token_ids
        if out.finish_reason is None:
            return
        del self.live[rid]
        self.ended.add(rid)
        self.stats.finish_reasons[out.finish_reason] += 1
        assert seq.is_finished and seq.block_table == []
        if out.finish_reason == "length":
            assert n_out == params.max_tokens
        elif out.finish_reason == "stop":
            last = seq.output_token_ids[-1]
            eos = not params.ignore_eos and last in self.engine.eos_token_ids
            assert last in params.stop_token_ids or eos
        if params.greedy:
            for t in seq.output_token_ids:
                assert 0 <= t < self.engine.vocab_size

    def _drain(self) -> None:
        # consecutive steps that gave no output and left nothing running: nobody fits the pool
        # (a step whose requests all finished ends with nothing running, but made progress)
        idle_steps = 0
        for _ in range(MAX_STEPS_TO_DRAIN):
            if not self.engine.has_unfinished():
                break
            outs = self._step()
            check_block_ledger(self.engine)
            idle_steps = 0 if outs or self.engine.scheduler.running else idle_steps + 1
            assert idle_steps < 2, (
                f"stuck: nothing can be scheduled, {self.engine.block_manager.num_free} of "
                f"{self.engine.block_manager.num_blocks} blocks free, waiting: {list(self.live)}"
            )
        else:
            pytest.fail(f"engine did not drain in {MAX_STEPS_TO_DRAIN} steps: {list(self.live)}")
        assert not self.live, f"drained engine, but never got a final output for {list(self.live)}"

    @invariant()
    def ledger(self) -> None:
        check_block_ledger(self.engine)
        assert set(self.engine.requests) == set(self.live)

    def teardown(self) -> None:
        self._drain()
        self.stats.preempted_requests += sum(s.num_preemptions > 0 for s in self.seqs.values())
        self.stats.draft_tokens += self.engine.spec_stats.num_draft_tokens
        self.stats.accepted_tokens += self.engine.spec_stats.num_accepted_tokens
        assert self.ended == set(self.seqs)
        for rid, outs in self.streamed.items():
            assert sum(o.finish_reason is not None for o in outs) == 1, rid
            assert outs[-1].finish_reason is not None
        bm = self.engine.block_manager
        assert sorted(bm.free_ids) == list(range(bm.num_blocks))
        assert all(b.ref_count == 0 for b in bm.blocks)
        assert_engine_idle(self.engine)




@pytest.fixture(scope="module")
def make_engine() -> Callable[[int], LLMEngine]:
    """Factory of tiny-model engines over one shared checkpoint (an engine takes ~5 ms)."""
    llama = tiny_checkpoint("llama")

    def make(num_blocks: int = NUM_BLOCKS, checkpoint: LoadedCheckpoint | None = None,
             **settings: Any) -> LLMEngine:
        config = EngineConfig(
            device="cpu", block_size=BLOCK_SIZE, kv_cache_memory=pool_bytes(num_blocks),
            max_num_seqs=6, max_num_batched_tokens=24, **settings,
        )
        engine = LLMEngine(config, checkpoint=checkpoint or llama)
        assert engine.block_manager.num_blocks == num_blocks
        assert engine.block_manager.block_size == BLOCK_SIZE
        return engine

    return make


def test_block_accounting_under_random_traffic(make_engine: Callable[[int], LLMEngine]) -> None:
    # a fresh engine per example (the block free-list order depends on history), so that a
    # failing example replays exactly; each example still has to end with its engine idle
    stats = RunStats()
    run_state_machine_as_test(
        lambda: EngineMachine(make_engine(NUM_BLOCKS), stats),
        settings=settings(
            max_examples=50, stateful_step_count=25, deadline=None,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
        ),
    )
    assert stats.requests > 0
    assert stats.preempted_requests > 0, f"the pool never ran out, preemption untested: {stats}"
    assert stats.aborted_live > 0, stats


# n-gram drafts of 3 tokens on suffixes of 1-2: the tiny random model repeats itself often
# enough that drafts are accepted, and far from always
SPECULATION = {"speculative_method": "ngram", "num_speculative_tokens": 3,
               "prompt_lookup_min": 1, "prompt_lookup_max": 2}


def test_block_accounting_under_random_traffic_with_speculation(
        make_engine: Callable[[int], LLMEngine]) -> None:
    """The same machine with speculative decoding: drafts are scheduled, verified, partly
    rejected (their slots and blocks given back), preempted and aborted mid-speculation."""
    stats = RunStats()
    run_state_machine_as_test(
        lambda: EngineMachine(make_engine(NUM_BLOCKS, **SPECULATION), stats),
        settings=settings(
            max_examples=40, stateful_step_count=25, deadline=None,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
        ),
    )
    assert stats.preempted_requests > 0 and stats.aborted_live > 0, stats
    assert 0 < stats.accepted_tokens < stats.draft_tokens, f"no accept or no reject: {stats}"
    assert stats.multi_token_outputs > 0, stats


WINDOW = 8  # tokens, two blocks: a tiny Mistral's sliding window
# a smaller pool: a request holds at most its window and a step's tokens, so 16 blocks ran out
# too rarely for 15 examples to preempt (seen in one run of the suite)
WINDOWED_BLOCKS = 10


@pytest.fixture(scope="module")
def windowed() -> LoadedCheckpoint:
    return tiny_checkpoint("mistral", sliding_window=WINDOW)


def test_block_accounting_under_random_traffic_with_a_sliding_window(
        make_engine: Callable[..., LLMEngine], windowed: LoadedCheckpoint) -> None:
    """The machine on a model whose every layer slides (8 tokens, two blocks), with
    speculation: blocks behind the window are freed as requests run, preempted, swapped and
    aborted, and the ledger holds after every action (`check_block_ledger`)."""
    stats = RunStats()
    run_state_machine_as_test(
        lambda: EngineMachine(make_engine(WINDOWED_BLOCKS, windowed, **SPECULATION), stats),
        settings=settings(
            max_examples=15, stateful_step_count=25, deadline=None,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
        ),
    )
    assert stats.preempted_requests > 0 and stats.aborted_live > 0, stats


def _held_per_step(engine: LLMEngine, prompt: list[int], max_tokens: int) -> tuple[
        list[int], list[int]]:
    """Run one greedy request alone: the blocks it held after each step (read from its
    table, as the block manager keeps it), and its tokens."""
    rid = engine.add_request(prompt_token_ids=prompt, params={
        "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True})
    seq = engine.requests[rid].seq
    held_after: list[int] = []
    while engine.has_unfinished():
        engine.step()
        held_after.append(held(seq.block_table) if not seq.is_finished else 0)
        check_block_ledger(engine)
    return held_after, seq.output_token_ids


def test_a_request_ten_windows_long_holds_its_windows_blocks_at_every_step(
        make_engine: Callable[..., LLMEngine], windowed: LoadedCheckpoint) -> None:
    """A Mistral-style request of 10x the window (6 + 80 tokens, 22 blocks of 4) holds at most
    ceil(window / block_size) + 1 = 3 blocks at every step, in a pool of 16 that could not hold
    it whole; the step timeline's KV line is flat at that height; its tokens are
    transformers'; and the ledger is clean after it. Negative control: the same request with
    the window's freeing off holds 21 blocks before its last step."""
    from transformers import AutoModelForCausalLM

    prompt, new = [5, 17, 300, 41, 1000, 7], 10 * WINDOW
    bound = -(-WINDOW // BLOCK_SIZE) + 1
    engine = make_engine(NUM_BLOCKS, windowed, timeline_steps=256)
    assert engine.block_manager.blocks_for(len(prompt) + new) > NUM_BLOCKS
    held_after, tokens = _held_per_step(engine, prompt, new)
    assert max(held_after) == bound, held_after
    kv_line = [s.kv_device_used for s in engine.recent_steps()]
    assert len(kv_line) == len(held_after) and max(kv_line) == bound, kv_line
    assert set(kv_line[WINDOW:-1]) <= {bound - 1, bound}, kv_line  # flat after the first window
    assert_engine_idle(engine)

    hf = AutoModelForCausalLM.from_config(windowed.config, dtype=torch.float32)
    hf.load_state_dict(windowed.tensors)
    assert tokens == hf_greedy(hf.eval(), {"p": prompt}, new)["p"].tokens

    keep_all = make_engine(64, windowed)
    keep_all.block_manager.sliding_window = None
    held_all, tokens_all = _held_per_step(keep_all, prompt, new)
    assert max(held_all) == 21 > 6 * bound  # 84 tokens' K/V before the last step
    assert tokens_all == tokens  # the window alone decides what is read


# -- preemption must not change what is generated -----------------------------------------------


def test_preemption_does_not_change_outputs(make_engine: Callable[[int], LLMEngine]) -> None:
    """Greedy and seeded requests produce the same tokens whether or not they were preempted."""
    requests = [
        {
            "prompt_token_ids": [(37 * i + 11 * j) % 49000 + 100 for j in range(20 + i)],
            "params": (
                {"max_tokens": 16, "temperature": 0.0, "ignore_eos": True}
                if i % 2 == 0
                else {"max_tokens": 16, "temperature": 1.0, "seed": 1000 + i, "ignore_eos": True}
            ),
            "request_id": f"r{i}",
        }
        for i in range(5)
    ]
    roomy = make_engine(256)
    small_engine = make_engine(NUM_BLOCKS)
    expected = {k: output_ids(v) for k, v in roomy.generate_all(requests).items()}
    seqs_before: dict[str, Sequence] = {}
    got: dict[str, list[RequestOutput]] = {}
    for r in requests:
        rid = small_engine.add_request(**r)
        seqs_before[rid] = small_engine.requests[rid].seq
        got[rid] = []
    while small_engine.has_unfinished():
        for out in small_engine.step():
            got[out.request_id].append(out)
        check_block_ledger(small_engine)
    assert any(s.num_preemptions for s in seqs_before.values()), "no preemption happened"
    assert {k: output_ids(v) for k, v in got.items()} == expected
    assert_engine_idle(small_engine)
    assert_engine_idle(roomy)

