"""Pure logic of the load-test reports: memory growth after warm-up, the baseline table and
plot, and the CLI's duration / user-count parsing."""

from __future__ import annotations

import argparse

import pytest

from cluster.memory_watch import MemorySample, MiB, memory_report, plot_memory, write_csv
from kvserve.bench.loadtest import LoadtestSummary
from kvserve.bench.loadtest_report import baseline_table, first_refusing, plot_baseline
from kvserve.cli.types import positive_ints, seconds


def test_memory_growth_counts_from_the_first_sample_after_warmup(tmp_path):
    samples = [MemorySample(t, "r1", int(rss * MiB)) for t, rss in
               [(0, 500), (30, 900), (60, 1000), (300, 1010), (600, 1030)]]
    samples += [MemorySample(t, "r2", 800 * MiB) for t in (0, 65, 600)]
    r1, r2 = memory_report(samples, warmup_s=60)
    assert (r1.replica_id, r1.start_mib, r1.warm_mib, r1.end_mib) == ("r1", 500, 1000, 1030)
    assert r1.growth_after_warmup_pct == pytest.approx(3.0)
    assert r2.growth_after_warmup_pct == 0
    rows = (write_csv(samples, tmp_path / "memory.csv")).read_text().splitlines()
    assert rows[0] == "t_s,replica_id,rss_mib" and rows[1:3] == ["0.0,r1,500.0", "30.0,r1,900.0"]
    png = plot_memory(samples, 60, tmp_path / "memory.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


def _summary(users: int, refused: int = 0, **extra) -> LoadtestSummary:
    failures = {"RESOURCE_EXHAUSTED": refused} if refused else {}
    latency = {"RESOURCE_EXHAUSTED": {"p50": 20.0, "p99": 95.0, "max": 120.0}} if refused else {}
    return LoadtestSummary(users=users, run_time_s=60, streams=10 * users, requests_per_s=users,
                           output_tokens=640 * users, output_tokens_per_s=10.0 * users,
                           ttft_p50_ms=100.0 * users, ttft_p99_ms=300.0 * users,
                           itl_p50_ms=50.0, itl_p99_ms=90.0, failures=failures,
                           failure_latency_ms=latency, **extra)


def test_baseline_marks_where_admission_control_starts_refusing(tmp_path):
    points = [_summary(64, refused=7), _summary(1), _summary(8), _summary(128, refused=300)]
    assert first_refusing(points) == 64
    assert first_refusing(points[1:3]) is None
    lines = baseline_table(points).splitlines()
    assert [line.split("|")[1].strip() for line in lines[2:]] == ["1", "8", "64", "128"]
    assert lines[4].split("|")[8:10] == [" 7 ", " 95 "]  # refused, refusal p99 ms
    png = plot_baseline(points, tmp_path / "baseline.png", "test")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_durations_and_user_counts_parse_or_explain():
    assert [seconds("30s"), seconds("10m"), seconds("90")] == [30, 600, 90]
    assert positive_ints("1,8,32,64") == [1, 8, 32, 64]
    for bad in ("ten", "0", ""):
        with pytest.raises(argparse.ArgumentTypeError):
            positive_ints(bad)
    with pytest.raises(argparse.ArgumentTypeError, match="30s or 10m"):
        seconds("5 minutes")
