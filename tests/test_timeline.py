"""The step recorder and request timelines: a scripted schedule, recorded and exported as
a Chrome trace, matches the scheduler's own decisions event for event."""

from __future__ import annotations

import json

import pytest

from kvserve.trace.chrome import TraceSource, chrome_trace, events_from_steps
from kvserve.workers.core.timeline import EVENT_KINDS
from tests.trace_format import trace_format_errors

pytestmark = pytest.mark.usefixtures("one_torch_thread")

GREEDY = {"max_tokens": 40, "ignore_eos": True}
LONG = [(i * 7) % 200 + 3 for i in range(1500)]


def _scripted(make_tiny_engine, **config):
    """Two requests decode while a 1,500-token prompt is prefilled in 512-token chunks (a
    514-token budget: two decodes and one chunk); the pool (98 blocks of 16) then runs out
    when the long request needs its 95th block, so it is preempted and swapped out to the
    host tier, and swapped back in once the two finish."""
    engine = make_tiny_engine(
        checkpoint_kwargs={"max_position_embeddings": 2048}, max_model_len=2048,
        max_num_batched_tokens=514, num_kv_blocks=98, num_host_kv_blocks=128, block_size=16,
        **config)
    decisions = []  # what the scheduler decided, step by step, read as it returns
    schedule = engine.scheduler.schedule

    def spy(budget=None):
        out = schedule(budget)
        if out.chunks:
            decisions.append({
                "chunks": [(c.seq.request_id, c.start, c.num_tokens) for c in out.chunks],
                "preempted": [(s.request_id, bool(s.host_table)) for s in out.preempted],
                "admitted": [s.request_id for s in out.admitted]})
        return out

    engine.scheduler.schedule = spy
    a = engine.add_request(prompt_token_ids=list(range(3, 19)), params=GREEDY)
    b = engine.add_request(prompt_token_ids=list(range(30, 46)), params=GREEDY)
    engine.step()
    c = engine.add_request(prompt_token_ids=LONG, params={"max_tokens": 8, "ignore_eos": True})
    last = {o.request_id: o for o in engine.run_until_done() if o.finished}
    return engine, decisions, (a, b, c), last


def test_a_scripted_schedule_is_recorded_and_traced_event_for_event(make_tiny_engine):
    engine, decisions, (a, b, c), last = _scripted(make_tiny_engine)
    steps = engine.recent_steps()
    # the schedule the script forces: 512-token chunks beside two decodes, then a swap
    assert [d["chunks"] for d in decisions[1:4]] == [
        [(a, 16, 1), (b, 16, 1), (c, 0, 512)], [(a, 17, 1), (b, 17, 1), (c, 512, 512)],
        [(a, 18, 1), (b, 18, 1), (c, 1024, 476)]]
    preemptions = [(i, p) for i, d in enumerate(decisions) for p in d["preempted"]]
    assert preemptions == [(8, (c, True))]  # at its 95th block: swapped, not recomputed
    assert [i for i, d in enumerate(decisions) if c in d["admitted"]] == [1, 40]

    # the records are the decisions, step by step
    assert len(steps) == len(decisions) == engine.num_steps
    for step, d in zip(steps, decisions, strict=True):
        assert [(x.request_id, x.start, x.num_tokens) for x in step.chunks] == d["chunks"]
        assert [(p.request_id, p.swapped) for p in step.preempted] == d["preempted"]
        assert list(step.admitted) == d["admitted"]
    # ...with the KV blocks each request gained and lost
    blocks = {(s.index, rid): act.as_dict() for s in steps for rid, act in s.blocks}
    assert blocks[(1, c)] == {"allocated": 32}
    assert blocks[(3, c)] == {"allocated": 30}  # 1,500 tokens: 94 blocks
    assert blocks[(8, c)] == {"freed": 94, "swapped_out": 94}
    assert blocks[(40, c)] == {"allocated": 95, "swapped_in": 94}
    assert steps[7].kv_device_used == 98 and steps[8].kv_host_used == 94
    assert sum(act.get("freed", 0) for (_, rid), act in blocks.items() if rid == a) == 4

    # the long request's own timeline: the same story, in order
    timeline = last[c].timeline
    kinds = [(e.kind, e.step, e.first, e.num_tokens, e.blocks, e.detail)
             for e in timeline.events]
    assert kinds[:6] == [("arrived", None, None, 0, 0, ""), ("admitted", 1, None, 0, 0, ""),
                         ("prefill", 1, 0, 512, 0, ""), ("prefill", 2, 512, 512, 0, ""),
                         ("prefill", 3, 1024, 476, 0, ""), ("first_token", 3, None, 0, 0, "")]
    assert kinds[10:14] == [("preempted", 8, None, 0, 0, "swap"),
                            ("swapped_out", 8, None, 0, 94, ""), ("resumed", 40, None, 0, 0, ""),
                            ("swapped_in", 40, None, 0, 94, "")]
    assert kinds[-1] == ("finished", 42, None, 0, 0, "length")
    assert [e.batch_size for e in timeline.of_kind("prefill")] == [3, 3, 3]
    times = [e.start for e in timeline.events]
    assert times == sorted(times)
    every = [e for r in (a, b, c) for e in last[r].timeline.events]
    assert {e.kind for e in every} == set(EVENT_KINDS)  # the script meets every kind

    # the Chrome trace: every decision is one slice on its request's track, and nothing else
    trace = chrome_trace([TraceSource("engine", steps, [last[r].timeline for r in (a, b, c)],
                                      engine.wall_offset)])
    assert trace_format_errors(json.loads(json.dumps(trace))) == []
    names = {}
    for e in trace["traceEvents"]:
        if e["ph"] == "M" and e["name"] == "thread_name":
            names[e["tid"]] = e["args"]["name"].removeprefix("request ")
    slices = sorted((names[e["tid"]], e["args"]["step"], e["args"]["position"],
                     e["args"]["tokens"]) for e in trace["traceEvents"]
                    if e["ph"] == "B" and e["cat"] == "request" and "step" in e.get("args", {}))
    assert slices == sorted((rid, i, start, n) for i, d in enumerate(decisions)
                            for rid, start, n in d["chunks"])
    instants = sorted((names[e["tid"]], e["name"]) for e in trace["traceEvents"]
                      if e["ph"] == "i" and e["name"] in ("preempted", "swapped_out",
                                                          "swapped_in", "resumed"))
    assert instants == [(c, "preempted"), (c, "resumed"), (c, "swapped_in"), (c, "swapped_out")]
    step_slices = [e for e in trace["traceEvents"] if e["ph"] == "B" and e["cat"] == "step"]
    assert [e["name"] for e in step_slices] == [f"step {i}" for i in range(len(decisions))]
    kv = [e["args"]["device_used"] for e in trace["traceEvents"]
          if e["ph"] == "C" and e["name"] == "KV blocks"]
    assert kv == [s.kv_device_used for s in steps]


def test_requests_still_running_are_drawn_from_the_steps_alone(make_tiny_engine):
    """An engine's recent steps, without timelines (a replica's status, a request not done):
    the same events, swaps included, rebuilt by the same function (`events_by_request`)."""
    engine, decisions, (a, b, c), last = _scripted(make_tiny_engine)
    steps = engine.recent_steps()
    rebuilt = events_from_steps(steps)
    for rid in (a, b, c):
        own = [(e.kind, e.step, e.first, e.num_tokens, e.detail)
               for e in last[rid].timeline.events
               if e.kind not in ("arrived", "first_token")]
        assert [(e.kind, e.step, e.first, e.num_tokens, e.detail) for e in rebuilt[rid]] == own
        assert [e.blocks for e in rebuilt[rid]] == [e.blocks for e in last[rid].timeline.events
                                                    if e.kind not in ("arrived", "first_token")]
    trace = chrome_trace([TraceSource("replica 1", steps, (), engine.wall_offset)])
    assert trace_format_errors(trace) == []


def test_the_format_checker_catches_broken_traces(make_tiny_engine):
    """Negative controls for the checker the tests above rely on."""
    engine, *_ = _scripted(make_tiny_engine)
    trace = chrome_trace([TraceSource("engine", engine.recent_steps(), (),
                                      engine.wall_offset)])
    assert trace_format_errors(trace) == []
    events = trace["traceEvents"]
    first_e = next(i for i, e in enumerate(events) if e["ph"] == "E")
    assert any("never ended" in m for m in trace_format_errors(
        {"traceEvents": events[:first_e] + events[first_e + 1:]}))
    steps = [i for i, e in enumerate(events) if e["ph"] == "B" and e["cat"] == "step"]
    swapped = list(events)
    swapped[steps[0]], swapped[steps[1]] = swapped[steps[1]], swapped[steps[0]]
    assert any("goes back" in m for m in trace_format_errors({"traceEvents": swapped}))
    assert any("phase" in m for m in trace_format_errors(
        {"traceEvents": [{**events[-1], "ph": "Q"}]}))
    assert any("no 'ts'" in m for m in trace_format_errors(
        {"traceEvents": [{k: v for k, v in events[-1].items() if k != "ts"}]}))


def test_prefix_hits_demotions_restores_and_aborts_are_recorded(make_tiny_engine):
    engine = make_tiny_engine(enable_prefix_caching=True, num_kv_blocks=12,
                              num_host_kv_blocks=32, block_size=16)
    prompt = list(range(3, 67))  # 4 full blocks
    engine.generate_all([{"prompt_token_ids": prompt, "params": {"max_tokens": 2}}])
    # fill the device so the cached blocks are demoted to the host tier
    flush = [(i * 5) % 150 + 3 for i in range(170)]
    engine.generate_all([{"prompt_token_ids": flush, "params": {"max_tokens": 2}}])
    out = engine.generate_all([{"prompt_token_ids": prompt, "params": {"max_tokens": 2}}])
    (final,) = [o for outs in out.values() for o in outs if o.finished]
    steps = engine.recent_steps()
    acts = [act for s in steps for rid, act in s.blocks if rid == final.request_id]
    kv = engine.kv_stats()
    assert sum(a.hit for a in acts) == 3 and sum(a.restored for a in acts) > 0
    # the per-request counts add up to the KV manager's own counters
    every = [a for s in steps for _, a in s.blocks]
    assert sum(a.restored for a in every) == kv.blocks_restored
    assert sum(a.demoted for a in every) == kv.blocks_offloaded > 0
    admitted = final.timeline.of_kind("admitted")
    assert [e.num_tokens for e in admitted] == [48] == [final.usage.cached_tokens]
    rid = engine.add_request(prompt_token_ids=prompt, params={"max_tokens": 20})
    engine.step()
    aborted = engine.abort(rid)
    assert aborted.timeline.events[-1].kind == "finished"
    assert aborted.timeline.events[-1].detail == "abort"


def test_recording_off_keeps_nothing_and_changes_no_output(make_tiny_engine):
    requests = [{"prompt_token_ids": list(range(3, 40)), "params": {"max_tokens": 6,
                                                                  "seed": 1}},
                {"prompt_token_ids": list(range(50, 60)), "params": {"max_tokens": 4,
                                                                      "seed": 2}}]
    on, off = make_tiny_engine(), make_tiny_engine(timeline_steps=0)
    outs = [e.generate_all(requests) for e in (on, off)]
    tokens = [[sum((o.token_ids for o in v), []) for v in out.values()] for out in outs]
    assert tokens[0] == tokens[1]
    assert off.recent_steps() == [] and on.recent_steps()
    assert all(o.timeline is None for v in outs[1].values() for o in v if o.finished)
    assert all(o.timeline is not None for v in outs[0].values() for o in v if o.finished)
    small = make_tiny_engine(timeline_steps=3)
    small.generate_all(requests)
    assert [s.index for s in small.recent_steps()] == list(range(small.num_steps - 3,
                                                                 small.num_steps))
