"""`kvserve bench serve` at tiny size against a real local Serve app (Ray Serve's gRPC proxy)."""

from __future__ import annotations

import json
import math

import pytest

from kvserve.bench.serve import run_serve_bench, summarize
from kvserve.cli import build_parser
from tests.serving import APP, DEFAULT_APP, serve_locally

USES_SHARED_RAY = "1"  # tests/serving.py: run with the modules of this group

pytestmark = pytest.mark.ray  # starts Ray, so also slow (tests/suite_plugin.py)

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


def test_bench_serve_over_http_counts_every_token_through_the_http_proxy():
    """--protocol http: /v1/completions streamed through Serve's HTTP proxy; `run_level`
    fails unless every request's chunks carried exactly output_len token ids."""
    with serve_locally(DEFAULT_APP, reuse=True, name=APP) as served:
        report = run_serve_bench(served.http_url, concurrency=[2], requests=3, prompt_len=16,
                                 output_len=8, progress=False, protocol="http",
                                 skip_engine=True)
    (level,) = report.to_dict()["levels"]
    assert level["service_tok_s"] > 0 and level["engine_tok_s"] is None
    assert level["tokens_per_message"] == 1.0  # one SSE chunk per engine output
    assert report.config["protocol"] == "http" and report.config["replicas"] == 1
    assert "over http" in summarize(report)


def test_cli_parses_bench_serve():
    args = build_parser().parse_args(["bench", "serve", "--target", "127.0.0.1:1"])
    assert args.concurrency == [1, 8, 32] and args.requests == 64 and not args.json
    assert args.protocol == "grpc"
    args = build_parser().parse_args(["bench", "serve", "--target", "h:1", "--concurrency",
                                      "1,4", "--skip-engine", "--json"])
    assert args.concurrency == [1, 4] and args.skip_engine and args.json
