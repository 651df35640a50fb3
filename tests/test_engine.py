"""The engine (kvserve/workers/engine.py) and the modules it is built from on a tiny random
Llama: the builder's checks at start, the input processor's refusals that change nothing,
and the output processor as the one place a request is forgotten, however it ends.

The engine's outputs against transformers: tests/test_greedy_exact.py; its blocks under random
traffic: tests/test_block_accounting.py; its step records: tests/test_timeline.py."""

from __future__ import annotations

import pytest

from kvserve.workers.config import EngineConfig
from kvserve.workers.engine import LLMEngine
from kvserve.workers.errors import InvalidRequestError
from kvserve.workers.model_executor.tiny import tiny_checkpoint
from tests.helpers import assert_engine_idle

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _state(engine: LLMEngine) -> tuple:
    """What a refused request must not change."""
    return (sorted(engine.requests), [s.request_id for s in engine.scheduler.waiting],
            [s.request_id for s in engine.scheduler.running], engine.block_manager.num_free,
            engine.num_steps, len(engine.recent_steps()))


def test_the_builder_refuses_a_pool_smaller_than_one_block():
    with pytest.raises(ValueError, match="smaller than one KV block"):
        LLMEngine(EngineConfig(device="cpu", kv_cache_memory=16), checkpoint=tiny_checkpoint())


def test_a_refused_request_names_its_field_and_changes_nothing(make_tiny_engine):
    engine = make_tiny_engine(max_model_len=64, timeline_steps=16)
    running = engine.add_request(prompt_token_ids=[1, 2, 3], params={"max_tokens": 8},
                                 request_id="running")
    engine.step()
    before = _state(engine)
    bad = {
        "prompt": {"prompt_token_ids": list(range(1, 65))},
        "max_tokens": {"prompt_token_ids": [1, 2], "params": {"max_tokens": 63}},
        "request_id": {"prompt_token_ids": [1], "request_id": running},  # already running
        "cache_salt": {"prompt_token_ids": [1], "cache_salt": 7},
        "params": {"prompt_token_ids": [1], "params": 0.5},
        "temperature": {"prompt_token_ids": [1], "params": {"temperature": -1}},
    }
    for field, request in bad.items():
        with pytest.raises(InvalidRequestError) as err:
            engine.add_request(**request)
        assert err.value.field == field, (field, err.value)
        assert _state(engine) == before, field
    outputs = [o for o in engine.run_until_done() if o.request_id == running]
    assert outputs[-1].finish_reason == "length"
    assert_engine_idle(engine)


def _end_every_way(engine: LLMEngine) -> None:
    """Requests that end by length, by a stop token, by abort while waiting and by abort
    while running, with drafts proposed for them on the way."""
    prompt = [5, 6, 7, 5, 6, 7, 5, 6]
    engine.add_request(prompt_token_ids=prompt, params={"max_tokens": 6}, request_id="length")
    engine.add_request(prompt_token_ids=prompt, request_id="stop",  # any token stops it
                       params={"max_tokens": 6, "stop_token_ids": list(range(engine.vocab_size))})
    engine.add_request(prompt_token_ids=prompt, params={"max_tokens": 30}, request_id="running")
    outputs = [*engine.step(), *engine.step()]
    engine.add_request(prompt_token_ids=prompt, params={"max_tokens": 6}, request_id="waiting")
    assert engine.abort("waiting").finish_reason == "abort"
    assert engine.abort("running").finish_reason == "abort"
    outputs += engine.run_until_done()
    ends = {o.request_id: o.finish_reason for o in outputs if o.finished}
    assert ends == {"length": "length", "stop": "stop"}


def test_every_way_a_request_ends_forgets_it_in_the_proposer_too(make_tiny_engine):
    """The draft model's shadow sequences and their KV blocks go with the request, whether it
    stops, reaches its length or is aborted. Negative control: with the output processor's
    `forget` hook removed, the same run leaves the draft's shadows and blocks behind."""
    for hooked in (True, False):
        engine = make_tiny_engine(speculative_method="draft_model", num_speculative_tokens=2,
                                  max_num_seqs=2)
        proposer = engine.proposer
        if not hooked:
            engine.output_processor.forget = None
        _end_every_way(engine)
        assert_engine_idle(engine)
        left = (len(proposer.shadows), proposer.kv.num_blocks - proposer.kv.num_free)
        assert (left == (0, 0)) == hooked, (hooked, left)


def test_a_finished_request_carries_its_timeline_and_leaves_no_state(make_tiny_engine):
    engine = make_tiny_engine(timeline_steps=32)
    [last] = [o for o in engine.generate_all(
        [{"prompt_token_ids": [1, 2, 3], "params": {"max_tokens": 3}}]).values()][0][-1:]
    kinds = [e.kind for e in last.timeline.events]
    assert kinds[:2] == ["arrived", "admitted"] and kinds[-1] == "finished"
    assert kinds.count("decode") == 2 and "first_token" in kinds
    assert engine.recent_timelines() == [last.timeline]
    assert_engine_idle(engine)
