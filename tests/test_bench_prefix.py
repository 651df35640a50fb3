"""`kvserve bench prefix` at tiny size: four settings, the same greedy chats, ratios reported."""

from __future__ import annotations

import json
import math

from kvserve.bench.prefix import SETTINGS, run_prefix_bench
from kvserve.cli import build_parser
from workers.config import EngineConfig


def test_bench_prefix_runs_every_setting_on_identical_chats(model_dir):
    report = run_prefix_bench(EngineConfig(device="cpu"), conversations=3, turns=2,
                              history_tokens=96, output_len=2, pool_fraction=0.25,
                              progress=False)
    result = json.loads(json.dumps({k: v for k, v in report.items() if k != "summary"}))
    assert list(result["settings"]) == list(SETTINGS)
    assert result["outputs_identical"] is True  # caching and the host tier change no token
    for key in ("ttft_turn5_ratio", "pressure_throughput_ratio"):
        assert math.isfinite(result[key]) and result[key] > 0
    settings = result["settings"]
    assert settings["no_caching"]["cached_tokens"] == 0
    assert settings["caching"]["prefix_hit_rate"] > 0.3  # turn 2 reuses turn 1's history
    assert all(len(s["ttft_ms_p50"]) == 2 for s in settings.values())
    assert settings["pressure_host_tier"]["stats"]["host_blocks"] > 0
    assert "ttft_turn5_ratio" in report["summary"] and "pressure_throughput_ratio" in \
        report["summary"]


def test_cli_parses_bench_prefix():
    args = build_parser().parse_args(["bench", "prefix"])
    assert (args.conversations, args.turns, args.json) == (8, 5, False)
    args = build_parser().parse_args(["bench", "prefix", "--conversations", "2", "--json"])
    assert args.conversations == 2 and args.json
