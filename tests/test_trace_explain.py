"""`kvserve trace --explain` on the default model: every shape it prints is the engine's real
cache and batch at that step (read here by an observer of our own, from the engine's internals,
not from the printer), and chunked prefill, a prefix-cache hit and a preemption with a swap each
show up in it."""

from __future__ import annotations

import pytest

from kvserve.trace.explain import explain_request, format_explain
from kvserve.trace.workload import TraceRequest
from kvserve.workers.config import EngineConfig
from kvserve.workers.engine import LLMEngine

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def tight_engine(real_checkpoint) -> LLMEngine:
    """18 device blocks of 16 and a host tier: the explained request and one companion
    outgrow it together; a 64-token budget chunks the explained prompt."""
    return LLMEngine(EngineConfig(device="cpu", num_kv_blocks=18, num_host_kv_blocks=64,
                                  block_size=16, max_num_batched_tokens=64,
                                  enable_prefix_caching=True), checkpoint=real_checkpoint)


def test_explain_prints_the_engines_real_tensors_through_chunks_a_hit_and_a_swap(tight_engine):
    engine = tight_engine
    prompt = ("The river runs past the old mill, under the stone bridge and into the town, "
              "where children wait by the water each morning for the ferry to cross. ") * 6
    truth: dict[int, dict] = {}  # what the engine itself holds at each step, for the request

    def spy(view):
        for rid, req in list(engine.requests.items()):
            if rid.startswith("explain") and rid in view.request_ids:
                seq = req.seq
                i = view.request_ids.index(rid)
                start = seq.num_computed_tokens  # before the update: this step's first token
                n = view.num_rows[i]
                truth[engine.num_steps] = {
                    "tokens": seq.token_ids[start:start + n], "first": start, "n": n,
                    "table": list(seq.block_table), "others": set(view.request_ids) - {rid},
                    "kv": [[list(k.shape), list(v.shape)] for k, v in engine.runner.kv_cache]}

    stop = engine.observe_forward(spy)
    companion = TraceRequest(0, {"prompt_token_ids": list(range(1000, 1040)),
                                 "params": {"max_tokens": 60, "ignore_eos": True}})
    try:
        report = explain_request(None, prompt, 60, cached=True, beside=[companion],
                                 arrive_step=1, engine=engine)
    finally:
        stop()
    bs, heads = engine.info.block_size, engine.hf_config.num_attention_heads
    steps = report["steps"]
    assert [s["step"] for s in steps] == sorted(truth)
    for s in steps:
        t = truth[s["step"]]
        end = t["first"] + t["n"]
        assert s["input_ids"] == t["tokens"] and s["input_shape"] == [t["n"]]
        assert s["positions"] == [t["first"], end - 1]
        read = t["table"][:-(-end // bs)]
        assert s["blocks_read"] == read
        written = {}
        for p in range(t["first"], end):
            written.setdefault(read[p // bs], []).append(p % bs)
        assert s["kv_cache"]["written"] == [{"block": b, "slots": [v[0], v[-1]]}
                                           for b, v in written.items()]
        assert s["kv_cache"]["layers"] == len(t["kv"]) == engine.hf_config.num_hidden_layers
        assert [s["kv_cache"]["shape"]] * 2 == t["kv"][0] and all(k == t["kv"][0]
                                                                  for k in t["kv"])
        assert s["kv_cache"]["shape"] == [18, bs, engine.hf_config.num_key_value_heads,
                                          engine.hf_config.head_dim]
        assert s["kv_cache"]["slots_filled"] == end
        assert s["attention_scores_shape"] == [heads, t["n"], end]
        assert set(s["batch"]) == t["others"]
        if "token" in s:  # greedy: the chosen token is the top of the real logits
            assert s["token"]["id"] == s["top"][0]["id"]
    # the three things the view exists to show
    assert report["cached_tokens"] > 0
    assert steps[0]["phase"].startswith(f"prefill {report['cached_tokens']}:")
    assert sum(s["phase"].startswith("prefill") for s in steps) >= 2  # chunked
    notes = [n for s in steps for n in s["events"]]
    for kind in ("preempted (swap)", "swapped out", "resumed", "swapped in"):
        assert any(n.startswith(kind) for n in notes), kind
    # it waits out the preemption between two of its steps, and goes on where it was
    resumed = next(i for i, s in enumerate(steps) if any(n.startswith("resumed")
                                                         for n in s["events"]))
    assert steps[resumed]["step"] > steps[resumed - 1]["step"] + 1
    assert steps[resumed]["positions"][0] == steps[resumed - 1]["positions"][1] + 1
    text = format_explain(report)
    assert f"K and V each 18 x {bs} x 3 x 64 float32" in text
    assert "! preempted (swap)" in text and "prefix cache" in text
