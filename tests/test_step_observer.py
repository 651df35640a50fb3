"""`LLMEngine.observe_steps`: the public view of each step that profilers, benchmarks and
timelines use instead of wrapping the scheduler or the model runner."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_every_step_is_reported_with_its_batch_and_phases_until_unsubscribed(make_tiny_engine):
    engine = make_tiny_engine(max_num_batched_tokens=8)
    records = []
    stop = engine.observe_steps(records.append)
    a = engine.add_request(prompt_token_ids=list(range(10, 22)), params={"max_tokens": 3,
                                                                         "ignore_eos": True})
    b = engine.add_request(prompt_token_ids=[5, 6, 7], params={"max_tokens": 2,
                                                              "ignore_eos": True})
    outputs = [engine.step()]
    # 12 + 3 prompt tokens in 8-token steps: a's first chunk alone, then a's rest and b's prompt
    first = records[0]
    assert (first.index, first.num_tokens, first.num_prefill_tokens, first.num_decodes,
            first.num_sampled, first.request_ids) == (0, 8, 8, 0, 0, (a,))
    assert outputs == [[]]
    while engine.has_unfinished():
        outputs.append(engine.step())
    assert len(records) == len(outputs) == engine.num_steps
    assert [r.index for r in records] == list(range(len(records)))
    # every sampled row is one output, and every computed token was scheduled for a request
    assert [r.num_sampled for r in records] == [len(o) for o in outputs]
    assert sum(r.num_tokens for r in records) == (12 + 3) + (3 - 1) + (2 - 1)
    assert {rid for r in records for rid in r.request_ids} == {a, b}
    for r in records:
        phases = (r.propose_s, r.schedule_s, r.copy_s, r.prepare_s, r.forward_s, r.sample_s,
                  r.detokenize_s)
        assert all(p >= 0 for p in phases) and r.forward_s > 0
        assert r.seconds == pytest.approx(sum(phases))
    assert records == sorted(records, key=lambda r: r.start)

    stop()  # unsubscribed: the next steps are not reported
    engine.generate_all([{"prompt_token_ids": [1, 2, 3], "params": {"max_tokens": 2}}])
    assert len(records) == len(outputs)
