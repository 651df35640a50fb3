"""`kvserve bench serve` at tiny size against a real local Serve app (Ray Serve's gRPC proxy)."""

from __future__ import annotations

import json
import math

import pytest

from kvserve.bench.serve import run_serve_bench, summarize
from kvserve.cli import build_parser
from tests.serving import APP, DEFAULT_APP, serve_locally

USES_SHARED_RAY = "1"  # tests/serving.py: run with the modules of this group

pytestmark = pytest.mark.ray  # starts Ray, so also slow (tests/conftest.py)

LEVEL_KEYS = {"concurrency", "service_tok_s", "engine_tok_s", "ttft_p50_ms", "ttft_p99_ms",
              "itl_p50_ms", "itl_p99_ms", "ratio"}


def test_bench_serve_reports_every_level_for_service_and_engine():
    with serve_locally(DEFAULT_APP, reuse=True, name=APP) as served:
        report = run_serve_bench(served.target, concurrency=[1, 2], requests=4, prompt_len=16,
                                 output_len=8, progress=False)
    result = json.loads(json.dumps(report.to_dict()))  # what --json prints
    assert [level["concurrency"] for level in result["levels"]] == [1, 2]
    for level in result["levels"]:
        assert set(level) >= LEVEL_KEYS
        for key in LEVEL_KEYS:
            assert math.isfinite(level[key]) and level[key] > 0, (key, level[key])
        assert level["ratio"] == level["service_tok_s"] / level["engine_tok_s"]
        assert level["ttft_p50_ms"] <= level["ttft_p99_ms"]
        assert level["itl_p50_ms"] <= level["itl_p99_ms"]
    assert result["config"]["requests"] == 4
    table = summarize(report)
    assert "service tok/s" in table and len(table.splitlines()) == 4


def test_cli_parses_bench_serve():
    args = build_parser().parse_args(["bench", "serve", "--target", "127.0.0.1:1"])
    assert args.concurrency == [1, 8, 32] and args.requests == 64 and not args.json
    args = build_parser().parse_args(["bench", "serve", "--target", "h:1", "--concurrency",
                                      "1,4", "--skip-engine", "--json"])
    assert args.concurrency == [1, 4] and args.skip_engine and args.json
