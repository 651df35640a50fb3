"""Pure logic of the load-test reports: memory growth after warm-up, the baseline table and
plot, the one percentile definition the load test and `bench serve` share, and the CLI's
duration / user-count parsing."""

from __future__ import annotations

import argparse
import json
import math
import os
from pathlib import Path

import pytest

from kvserve.bench.common import percentile
from kvserve.bench.loadtest import LoadtestConfig, LoadtestSummary, _latency_stats, summarize
from kvserve.bench.loadtest_report import baseline_table, first_refusing, plot_baseline
from kvserve.bench.serve import RequestTiming, RunResult
from kvserve.cli.types import positive_ints, seconds
from kvserve.cluster.memory_watch import MemorySample, MiB, memory_report, plot_memory, write_csv


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


def _interpolated(values: list[float], q: float) -> float:
    """numpy.percentile's default ("linear"), written out: rank h = (n - 1) q / 100 between the
    sorted values at floor(h) and floor(h) + 1."""
    ordered = sorted(values)
    h = (len(ordered) - 1) * q / 100
    lo = math.floor(h)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (h - lo) * (ordered[hi] - ordered[lo])


def test_one_percentile_definition_linear_interpolation():
    values = [40.0, 10.0, 30.0, 20.0]
    assert percentile(values, 50) == pytest.approx(25.0)  # nearest rank would say 30
    assert percentile(values, 99) == pytest.approx(39.7)  # nearest rank would say 40
    assert percentile([7.0], 99) == 7.0
    assert math.isnan(percentile([], 50))
    spread = [float((i * 37) % 101) for i in range(250)]
    for q in (0, 1, 50, 90, 99, 100):
        assert percentile(spread, q) == pytest.approx(_interpolated(spread, q))


def test_load_test_and_bench_serve_p99_mean_the_same():
    """The failure-latency p99 of `kvserve loadtest` and the TTFT p99 of `kvserve bench serve`
    of the same samples agree (before the shared definition: 40 vs 39.7)."""
    ms = [40.0, 10.0, 30.0, 20.0]
    stats = _latency_stats(ms)
    assert stats == {"p50": 25.0, "p90": 37.0, "p99": 39.7, "max": 40.0}
    run = RunResult(1, 1.0, [RequestTiming(t, [], 1, 1) for t in ms])
    assert run.ttft_ms(99) == pytest.approx(stats["p99"]) and run.ttft_ms(50) == stats["p50"]


LOCUST_STATS = """Type,Name,Request Count,Requests/s,50%,99%
grpc,stream,4,0.5,900,1000
grpc,TTFT,4,0.5,120,200
grpc,ITL,4,0.5,11,19
"""


def test_summary_takes_ttft_and_itl_percentiles_from_the_raw_samples(tmp_path):
    (tmp_path / "locust_stats.csv").write_text(LOCUST_STATS)
    cfg = LoadtestConfig(target="h:1", out=tmp_path, run_time_s=8)
    totals = {"output_tokens": 40, "ttft_ms": [100.0, 110.0, 130.0, 190.0],
              "itl_ms": [10.0] * 9 + [20.0], "e2el_ms": [800.0, 900.0, 1000.0, 2000.0]}
    s = summarize(cfg, totals, elapsed_s=9.0)
    assert s.e2el_p50_ms == pytest.approx(950.0) and s.e2el_p99_ms == pytest.approx(1970.0)
    assert (s.streams, s.run_time_s, s.output_tokens_per_s) == (4, 8, 5.0)
    assert s.ttft_p50_ms == pytest.approx(120.0) and s.ttft_p99_ms == pytest.approx(188.2)
    assert s.itl_p50_ms == pytest.approx(10.0) and s.itl_p99_ms == pytest.approx(19.1)
    # a totals file without samples (an older locustfile): Locust's own columns
    old = summarize(cfg, {"output_tokens": 40}, elapsed_s=9.0)
    assert (old.ttft_p50_ms, old.ttft_p99_ms, old.itl_p99_ms) == (120.0, 200.0, 19.0)
    assert old.e2el_p50_ms is None  # Locust's stream row counts the failed streams too
    # samples recorded but none came (every stream failed before its first token): no number
    none = summarize(cfg, {"output_tokens": 0, "ttft_ms": [], "itl_ms": []}, elapsed_s=9.0)
    assert none.ttft_p99_ms is None and none.itl_p50_ms is None


def test_summary_counts_every_stream_that_ended_not_locusts_early_csv(tmp_path):
    """Locust writes its CSVs when the run time is up, before the streams still running end
    within its stop timeout; the locustfile records every end. Under load the CSV missed
    admitted streams (210 streams and 7 completed, where 213 and 10 ended)."""
    (tmp_path / "locust_stats.csv").write_text(LOCUST_STATS)  # its stream row: 4 requests
    cfg = LoadtestConfig(target="h:1", out=tmp_path, run_time_s=8)
    ends = [[100.5, "RESOURCE_EXHAUSTED"]] * 3 + [[104.0, "OK"]] * 2 + [[110.0, "OK"]]
    totals = {"output_tokens": 60, "start": 100.0, "ends": ends,
              "failure_ms": {"RESOURCE_EXHAUSTED": [20.0, 30.0, 40.0]}}
    s = summarize(cfg, totals, elapsed_s=12.0)
    assert (s.streams, s.requests_per_s, s.failures) == (6, 0.6, {"RESOURCE_EXHAUSTED": 3})
    old = summarize(cfg, {"output_tokens": 60}, elapsed_s=12.0)  # an older locustfile: the CSV
    assert old.streams == 4


def test_the_watch_counts_replicas_and_the_load_plot_shows_them_with_users_and_refusals(
        tmp_path):
    """Autoscaling's record: the replica count each time the watch samples, the users and
    cumulative failures from Locust's history rows, and a plot of the three."""
    from kvserve.bench.loadtest import _changes, format_summary, load_history, plot_load
    from kvserve.cluster.memory_watch import MemoryWatch

    replies = iter([{"a": MiB}, {"a": MiB, "b": MiB}, {"a": MiB, "b": 0, "c": MiB}])
    watch = MemoryWatch(lambda: next(replies), interval_s=3600)
    with watch:
        watch._sample()
    assert [n for _, n in watch.replica_counts] == [1, 2, 3]  # a row without RSS still counts
    assert {s.replica_id for s in watch.samples} == {"a", "b", "c"}

    started = 1_700_000_000.0
    header = ("Timestamp,User Count,Type,Name,Requests/s,Failures/s,50%,Total Request Count,"
              "Total Failure Count\n")
    rows = [f"{int(started) + t},{u},,Aggregated,1,0,10,{t},{f}\n"
            for t, u, f in [(1, 2, 0), (2, 4, 3), (3, 6, 9), (4, 6, 9)]]
    rows.insert(2, f"{int(started) + 2},4,grpc,stream,1,0,10,2,3\n")  # not an aggregate row
    (tmp_path / "history.csv").write_text(header + "".join(rows))
    load = load_history(tmp_path / "history.csv", started)
    assert load == [[1.0, 2, 0], [2.0, 4, 3], [3.0, 6, 9], [4.0, 6, 9]]

    summary = _summary(6)
    summary.load_over_time, summary.files = load, [str(tmp_path / "locust_stats.csv")]
    summary.replicas_over_time = [[0.0, 1], [2.0, 1], [4.0, 2], [6.0, 3], [8.0, 1]]
    assert _changes(summary.replicas_over_time) == "1 -> 2 (at 4 s) -> 3 (at 6 s) -> 1 (at 8 s)"
    assert "replicas           1 -> 2 (at 4 s)" in format_summary(summary)
    png = plot_load(summary, tmp_path / "load.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


def test_refusals_are_counted_under_the_replica_count_serving_when_each_stream_ended():
    """Whether refusals fall as replicas come up: each stream's end goes to the replica count
    sampled last before it; refusals are RESOURCE_EXHAUSTED or HTTP 429, not other failures."""
    from kvserve.bench.loadtest import format_summary, refusals_by_replicas

    replicas = [[0.0, 1], [2.0, 1], [4.0, 2], [6.0, 3], [8.0, 3]]
    ends = [(-0.5, "OK"), (1.0, "RESOURCE_EXHAUSTED"), (3.9, "RESOURCE_EXHAUSTED"),
            (4.0, "OK"), (5.0, "HTTP_429"), (5.5, "UNAVAILABLE"), (7.0, "OK"), (9.0, "OK")]
    rows = refusals_by_replicas(ends, replicas)
    assert rows == [
        {"replicas": 1, "seconds": 4.0, "streams": 3, "refused": 2, "refused_share": 0.667},
        {"replicas": 2, "seconds": 2.0, "streams": 3, "refused": 1, "refused_share": 0.333},
        {"replicas": 3, "seconds": 2.0, "streams": 2, "refused": 0, "refused_share": 0.0}]
    assert refusals_by_replicas(ends, []) == []  # no cluster to watch
    summary = _summary(6)
    summary.files = ["out/locust_stats.csv"]
    summary.refusals_by_replicas = rows
    assert "refused, by replicas serving  1: 2/3, 2: 1/3, 3: 0/2" in format_summary(summary)


def test_the_load_shapes_and_the_cli_name_the_same_shapes(monkeypatch):
    """`--shape`'s choices are the locustfile's shapes; ramp-hold rises over the first half of
    the run, or at `--spawn-rate` users per second, and holds the peak to the end. Run in a
    subprocess: importing Locust monkey-patches its process for gevent."""
    import subprocess
    import sys

    from kvserve.cli.loadtest import add_loadtest

    parser = argparse.ArgumentParser()
    add_loadtest(parser.add_subparsers())
    shape = next(a for a in parser._subparsers._group_actions[0].choices["loadtest"]._actions
                 if a.dest == "shape")
    probe = ("import json, shapes\n"
             "s = shapes.by_name('ramp-hold')(); ticks = []\n"
             "for t in (0, 1, 2.5, 4.5, 5, 10, 15, 20, 30, 39, 41):\n"
             "    s.get_run_time = lambda t=t: t; ticks.append(s.tick())\n"
             "print(json.dumps([sorted(shapes.SHAPES), ticks]))")

    def ticks(**env: str) -> list:
        env = {**os.environ, "KVSERVE_USERS": "10", "KVSERVE_RUN_TIME_S": "40", **env}
        done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                              cwd=Path(__file__).parents[1] / "kvserve/bench/locust", check=True,
                              env=env)
        names, ticks = json.loads(done.stdout)
        assert sorted(shape.choices) == names and "ramp-hold" in names
        return ticks

    monkeypatch.delenv("KVSERVE_SPAWN_RATE", raising=False)
    over_half = ticks()
    assert [t and t[0] for t in over_half] == [1, 1, 1, 2, 2, 5, 8, 10, 10, 10, None]
    at_two = ticks(KVSERVE_SPAWN_RATE="2")  # `--spawn-rate 2`: 2 users a second, then the peak
    assert [t and t[0] for t in at_two] == [1, 3, 6, 10, 10, 10, 10, 10, 10, 10, None]
    assert {t[1] for t in at_two[:-1]} == {2.0}


def test_loadtest_passes_the_locustfile_this_runs_settings_and_no_stale_ones(monkeypatch):
    """`--spawn-rate` and `--shape` reach the locustfile when given; when not, a value left in
    the caller's environment does not (it would silently reshape the load)."""
    from kvserve.bench.loadtest import LoadtestConfig, locust_command, locust_env

    for name in ("KVSERVE_SPAWN_RATE", "KVSERVE_SHAPE", "KVSERVE_API_KEY"):
        monkeypatch.setenv(name, "stale")
    cfg = LoadtestConfig(target="127.0.0.1:1", out=Path("out"), users=8)
    env = locust_env(cfg, Path("out/tokens.json"))
    assert {"KVSERVE_SPAWN_RATE", "KVSERVE_SHAPE", "KVSERVE_API_KEY"}.isdisjoint(env)
    assert locust_command(cfg)[locust_command(cfg).index("-r") + 1] == "8.0"  # Locust's own
    cfg = LoadtestConfig(target="127.0.0.1:1", out=Path("out"), users=8, shape="ramp-hold",
                         spawn_rate=0.5, api_key="k")
    env = locust_env(cfg, Path("out/tokens.json"))
    assert (env["KVSERVE_SHAPE"], env["KVSERVE_SPAWN_RATE"], env["KVSERVE_API_KEY"]) == (
        "ramp-hold", "0.5", "k")
    assert env["KVSERVE_USERS"] == "8" and env["KVSERVE_TOKENS_FILE"] == "out/tokens.json"


def test_a_spawn_rate_that_is_not_above_zero_is_refused_naming_the_flag():
    """`--spawn-rate 0` (or a word) is a usage error naming the flag, before anything starts."""
    from tests.test_cli import run

    for bad in ("0", "-1", "fast"):
        out = run("loadtest", "--spawn-rate", bad, "--target", "127.0.0.1:1")
        assert out.returncode == 2, out.stderr
        assert f"argument --spawn-rate: {bad!r}: give a number above 0" in out.stderr
