"""`kvserve bench speculative` at tiny size: both engines, every workload, the same tokens."""

from __future__ import annotations

import json

from kvserve.bench.speculative import INPUT_GROUNDED, run_speculative_bench, workloads
from kvserve.cli import build_parser
from kvserve.workers.config import EngineConfig


def test_bench_speculative_reports_every_cell_with_identical_outputs(model_dir):
    requests = 2
    report = run_speculative_bench(EngineConfig(device="cpu"), output_len=16, requests=requests,
                                   batch_sizes=(1, 2), progress=False)
    result = json.loads(json.dumps({k: v for k, v in report.items() if k != "summary"}))
    assert result["speculative_method"] == "ngram"  # the default when the flags name none
    cells = {(r["workload"], r["batch"]) for r in result["rows"]}
    assert cells == {(w, b) for w in workloads() for b in (1, 2)}
    assert result["outputs_identical"] is True
    for row in result["rows"]:
        assert row["input_grounded"] == (row["workload"] in INPUT_GROUNDED)
        assert row["speedup"] > 0 and row["plain"]["draft_tokens"] == 0
    quoting = [r for r in result["rows"] if r["workload"] == "quoting_summaries"]
    assert all(r["speculative"]["accepted_tokens"] > 0 for r in quoting)  # it copies the text
    assert all(r["lookup_ceiling"] > 1 for r in quoting)
    for row in result["rows"]:  # the engine's own prompt lookup stays under the ceiling
        spec = row["speculative"]
        if row["batch"] == 1:  # one prefill step per request, then its decode steps
            decode_per_step = (spec["output_tokens"] - requests) / (spec["steps"] - requests)
            assert 1 <= decode_per_step <= row["lookup_ceiling"] + 1e-9, row
    assert "quoting_summaries" in report["summary"] and "ceiling" in report["summary"]


def test_cli_parses_bench_speculative():
    args = build_parser().parse_args(["bench", "speculative"])
    assert (args.output_len, args.requests, args.json, args.speculative_method) == (
        128, 8, False, None)
    args = build_parser().parse_args(["bench", "speculative", "--speculative-method",
                                      "draft_model", "--num-speculative-tokens", "6", "--json"])
    assert (args.speculative_method, args.num_speculative_tokens, args.json) == (
        "draft_model", 6, True)
