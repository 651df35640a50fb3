"""`kvserve bench prefix` at tiny size: four settings, the same greedy chats, ratios reported."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest

from kvserve.bench.prefix import SETTINGS, ChatWorkload, SettingResult, _report, run_prefix_bench
from kvserve.cli import build_parser
from kvserve.workers.config import EngineConfig
from kvserve.workers.core.outputs import KVCacheStats


def test_bench_prefix_runs_every_setting_on_identical_chats(model_dir):
    report = run_prefix_bench(EngineConfig(device="cpu"), conversations=3, turns=2,
                              history_tokens=96, output_len=2, pool_fraction=0.25,
                              progress=False)
    result = json.loads(json.dumps({k: v for k, v in report.items() if k != "summary"}))
    assert list(result["settings"]) == list(SETTINGS)
    assert result["outputs_identical"] is True  # caching and the host tier change no token
    for key in ("ttft_last_turn_ratio", "pressure_throughput_ratio"):
        assert math.isfinite(result[key]) and result[key] > 0
    settings = result["settings"]
    assert result["ttft_last_turn_ratio"] == pytest.approx(
        settings["no_caching"]["ttft_ms_p50"][1] / settings["caching"]["ttft_ms_p50"][1])
    assert settings["no_caching"]["cached_tokens"] == 0
    assert settings["caching"]["prefix_hit_rate"] > 0.3  # turn 2 reuses turn 1's history
    assert all(len(s["ttft_ms_p50"]) == 2 for s in settings.values())
    assert settings["pressure_host_tier"]["stats"]["host_blocks"] > 0
    assert "ttft_last_turn_ratio (turn 2," in report["summary"]
    assert "pressure_throughput_ratio" in report["summary"]


def test_cli_parses_bench_prefix():
    args = build_parser().parse_args(["bench", "prefix"])
    assert (args.conversations, args.turns, args.json) == (8, 5, False)
    args = build_parser().parse_args(["bench", "prefix", "--conversations", "2", "--json"])
    assert args.conversations == 2 and args.json


def _setting(name: str, ttfts: list[float]) -> SettingResult:
    stats = KVCacheStats(**{f.name: 0 for f in dataclasses.fields(KVCacheStats)})
    return SettingResult(name, ttfts, output_tokens=10, prompt_tokens=100, cached_tokens=0,
                         seconds=1.0, max_prompt_tokens=50, stats=stats, outputs=[[1, 2]])


@pytest.mark.parametrize("turns", [3, 7])
def test_ttft_ratio_is_the_last_turns_whatever_the_number_of_turns(turns):
    """The ratio is named for and taken from turn `turns`, not turn 5: with 3 turns there is no
    turn 5, with 7 turn 5 is not the last (per-turn TTFTs here all differ, so any other turn's
    ratio would differ from the expected one)."""
    slow = [1000.0 + 10 * t for t in range(turns)]
    fast = [1000.0] + [100.0 - t for t in range(1, turns)]
    results = {name: _setting(name, slow if name == "no_caching" else fast) for name in SETTINGS}
    work = ChatWorkload(["doc"], turns, output_len=2)
    report = _report(results, work, pool=4, work_blocks=16)
    assert "ttft_turn5_ratio" not in report
    assert report["ttft_last_turn_ratio"] == pytest.approx(slow[turns - 1] / fast[turns - 1])
    others = {slow[t] / fast[t] for t in range(turns - 1)}
    assert all(r != pytest.approx(report["ttft_last_turn_ratio"]) for r in others)
    assert f"ttft_last_turn_ratio (turn {turns}," in report["summary"]
