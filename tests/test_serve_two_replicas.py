"""Two replicas serve 16 concurrent streaming gRPC clients; every greedy output equals the
in-process engine's; both replicas receive traffic (seen in their metrics)."""

from __future__ import annotations

import re
from concurrent.futures import ThreadPoolExecutor

import pytest

from kvserve.trace.chrome import chrome_trace
from kvserve.trace.remote import replica_sources
from tests.helpers import poll, solo_ids_each
from tests.prompts import varied_prompts
from tests.serving import TWO_REPLICAS, serve_locally
from tests.trace_format import trace_format_errors

USES_SHARED_RAY = "3b"  # tests/serving.py: run with the modules of this group

pytestmark = pytest.mark.ray  # starts Ray, so also slow (tests/suite_plugin.py)


def test_two_replicas_serve_16_concurrent_clients_exactly(real_engine):
    tok = real_engine.tokenizer
    texts = [tok.decode(ids) for name, ids in varied_prompts(tok).items() if name != "long_1500"]
    prompts = [f"{texts[i % len(texts)]} ({i})" for i in range(16)]
    expected = dict(zip(prompts, solo_ids_each(real_engine, [
        {"prompt": p, "params": {"temperature": 0, "max_tokens": 12}} for p in prompts]),
        strict=True))
    with serve_locally(TWO_REPLICAS, reuse=True) as served:
        before = _finished_per_replica(served)  # the deployment may have served earlier tests
        with ThreadPoolExecutor(16) as pool:
            results = dict(
                zip(
                    prompts,
                    pool.map(lambda i_p: served.stream(i_p[1], temperature=0, max_tokens=12,
                                                       request_id=f"two-{i_p[0]}"),
                             enumerate(prompts)),
                    strict=True,
                )
            )
        for prompt, responses in results.items():
            assert [t for r in responses for t in r.token_ids] == expected[prompt], prompt
        replicas = poll(lambda: _replicas_with_traffic(served, before), lambda s: len(s) >= 2,
                        30, 1.0)  # metrics report each second
        sources = replica_sources(served.app)  # what `kvserve trace --deployment` draws
    assert len(replicas) == 2, replicas
    # each replica's recorded steps hold the requests it served: together, all 16, once
    ours = {}
    for source in sources:
        ended = {t.request_id: t for t in source.timelines}
        for step in source.steps:
            for chunk in step.chunks:
                ours.setdefault(chunk.request_id, set()).add(source.name)
        assert ended and all(t.events[-1].kind == "finished" for t in ended.values())
    served_here = {rid for rid, names in ours.items() if rid.startswith("two-")}
    assert len(sources) == 2 and len(served_here) == 16
    assert all(len(ours[rid]) == 1 for rid in served_here)  # never split across replicas
    trace = chrome_trace(sources)
    assert trace_format_errors(trace) == []
    assert {e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "process_name"} == {
        s.name for s in sources}


def _finished_per_replica(served) -> dict[str, float]:
    """Each replica tag's finished-request counter, as Prometheus has it now."""
    counts: dict[str, float] = {}
    for labels, value in served.metrics().get("ray_kvserve_request_success_total", []):
        match = re.search(r'replica="([^"]+)"', labels)
        if match:
            counts[match.group(1)] = counts.get(match.group(1), 0) + value
    return counts


def _replicas_with_traffic(served, before: dict[str, float]) -> set[str]:
    """Replica tags whose finished-request counter grew since `before`."""
    return {tag for tag, n in _finished_per_replica(served).items() if n > before.get(tag, 0)}
