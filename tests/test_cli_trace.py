"""`kvserve trace` on the default model and its built-in mixed workload: the files it writes, and
the events the workload exists to show (chunked prefill, a prefix-cache hit, a preemption with
a swap) are in them."""

from __future__ import annotations

import json

import pytest

from kvserve.cli import main
from tests.trace_format import trace_format_errors

pytestmark = pytest.mark.slow


def test_trace_writes_a_valid_perfetto_trace_a_picture_and_the_timelines(tmp_path, capsys):
    assert main(["trace", "--out", str(tmp_path), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["requests"] == 6 and not summary["truncated"]
    assert summary["prefill_chunks"] >= 3 + 5  # the document's 3 chunks, 5 more requests
    assert summary["preemptions"] >= 1
    assert summary["blocks_swapped_out"] == summary["blocks_swapped_in"] > 0
    assert summary["prefix_hit_tokens"] > 0

    trace = json.loads((tmp_path / "trace.json").read_text())
    assert trace_format_errors(trace) == []
    names = [e["name"] for e in trace["traceEvents"]]
    for name in ("preempted", "swapped_out", "swapped_in", "resumed", "first_token", "queued"):
        assert name in names, name
    assert sum(e["name"].startswith("prefill ") for e in trace["traceEvents"]
               if e["ph"] == "B") == summary["prefill_chunks"]
    counters = {e["name"] for e in trace["traceEvents"] if e["ph"] == "C"}
    assert counters == {"KV blocks", "batch", "queue"}
    tracks = [e["args"]["name"] for e in trace["traceEvents"]
              if e["ph"] == "M" and e["name"] == "thread_name"]
    assert tracks[0] == "engine steps" and len(tracks) == 1 + 6
    assert any("prefix-cache hit" in t for t in tracks)

    png = (tmp_path / "timeline.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 20_000
    steps = [json.loads(line) for line in (tmp_path / "steps.jsonl").read_text().splitlines()]
    assert len(steps) == summary["steps"]
    assert [s["index"] for s in steps] == list(range(len(steps)))
    requests = [json.loads(line)
                for line in (tmp_path / "requests.jsonl").read_text().splitlines()]
    assert len(requests) == 6
    hit = next(r for r in requests if "prefix-cache hit" in r["label"])
    assert hit["usage"]["cached_tokens"] > 0
    admitted = next(e for e in hit["events"] if e["kind"] == "admitted")
    assert admitted["num_tokens"] == hit["usage"]["cached_tokens"]


def test_explain_on_the_command_line_prints_the_steps_and_writes_json(tmp_path, capsys):
    assert main(["trace", "--explain", "The capital of France is", "--max-tokens", "3",
                 "--out", str(tmp_path)]) == 0
    text = capsys.readouterr().out
    report = json.loads((tmp_path / "explain.json").read_text())
    assert [s["t"] for s in report["steps"]] == [0, 1, 2]
    assert "t=0" in text and "t=2" in text and "attention scores 9 x 1 x" in text
    assert "K and V each" in text and "top-5" in text


def test_a_bad_explain_request_is_one_line_naming_the_field(tmp_path, capsys):
    assert main(["trace", "--explain", "Hi", "--max-tokens", "0", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.strip() == "kvserve: invalid request: max_tokens: must be >= 1, got 0"
    assert main(["trace", "--explain", "", "--out", str(tmp_path)]) == 2
    assert "prompt" in capsys.readouterr().err
