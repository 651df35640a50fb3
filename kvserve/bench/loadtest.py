"""`kvserve loadtest`: headless Locust over gRPC or HTTP against a deployment, with a one-screen
summary.

Runs `locust/locustfile.py` in its own process (gevent stays out of ours), writes Locust's
CSV and HTML reports to `--out`, and summarises them: requests/s, output tokens/s, TTFT and ITL
p50/p99 (from the streams' raw samples, by the percentile `kvserve bench serve` uses), failures
by gRPC status (or HTTP status, HTTP_429) and how fast they came. Without `--target` it
starts a local deployment first (`kvserve up --detach`) and stops it afterwards (`kvserve
down`). Given a way to read the replicas' status rows it also reports their resident memory
(soak runs), and given
several user counts it runs one load per count (the baseline sweep, `loadtest_report`).
"""

from __future__ import annotations

import bisect
import csv
import itertools
import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from kvserve.bench.common import percentile
from kvserve.cluster.memory_watch import MemoryWatch, memory_report, plot_memory, write_csv

LOCUSTFILE = Path(__file__).resolve().with_name("locust") / "locustfile.py"
WORKLOADS = {"short": ["ShortChatUser"], "long": ["LongPromptUser"], "mixed": ["MixedUser"],
             "multiturn": ["MultiTurnUser"],
             "all": ["ShortChatUser", "LongPromptUser", "MixedUser", "MultiTurnUser"]}
SPAWN_RATE = 8.0  # users started per second when --spawn-rate is not given (Locust's -r)
REFUSED = "RESOURCE_EXHAUSTED"  # admission control's answer over gRPC
REFUSALS = (REFUSED, "HTTP_429")  # ... and over HTTP


@dataclass
class LoadtestConfig:
    target: str
    out: Path
    users: int = 8
    spawn_rate: float | None = None  # users/s; None: SPAWN_RATE, ramp-hold's over half the run
    run_time_s: float = 60.0
    workload: str = "mixed"
    shape: str | None = None  # steady | ramp | ramp-hold | spike; None: Locust's own (all users)
    seed: int = 0
    timeout_s: float = 600.0  # each stream's gRPC deadline
    warmup_s: float = 60.0  # memory growth is measured from here (capped at a quarter of the run)
    protocol: str = "grpc"  # or "http": the OpenAI-compatible API (target http://HOST:PORT)
    api_key: str | None = None


@dataclass
class LoadtestSummary:
    users: int
    run_time_s: float
    streams: int  # streams that ended, the failed (refused) ones included
    requests_per_s: float
    output_tokens: int
    output_tokens_per_s: float
    ttft_p50_ms: float | None
    ttft_p99_ms: float | None
    itl_p50_ms: float | None
    itl_p99_ms: float | None
    # request to last message of the streams that finished (vLLM's e2el)
    e2el_p50_ms: float | None = None
    e2el_p99_ms: float | None = None
    failures: dict[str, int] = field(default_factory=dict)  # gRPC status -> count
    # gRPC status -> {"p50", "p90", "p99", "max"} ms from request to the error: how fast
    # refusals come
    failure_latency_ms: dict[str, dict[str, float]] = field(default_factory=dict)
    replica_memory: list[dict] = field(default_factory=list)  # memory_watch.ReplicaMemory dicts
    # [t_s, replicas serving] every 2 s, given the cluster (autoscaling, replacements)
    replicas_over_time: list[list[float]] = field(default_factory=list)
    # [t_s, users, refusals and other failures so far], one per Locust history row
    load_over_time: list[list[float]] = field(default_factory=list)
    # per replica count (given the cluster): the streams that ended while that many replicas
    # served, how many were refused, and the seconds at that count: do refusals fall as
    # replicas come up?
    refusals_by_replicas: list[dict] = field(default_factory=list)
    files: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)


def locust_command(cfg: LoadtestConfig) -> list[str]:
    prefix = cfg.out / "locust"
    return [sys.executable, "-m", "locust", "-f", str(LOCUSTFILE), "--headless",
            "--host", cfg.target, "-u", str(cfg.users), "-r", str(cfg.spawn_rate or SPAWN_RATE),
            "-t", f"{int(cfg.run_time_s)}s", "--stop-timeout", "120", "--csv", str(prefix),
            "--html", str(cfg.out / "report.html"), "--only-summary", *WORKLOADS[cfg.workload]]


def locust_env(cfg: LoadtestConfig, tokens_file: Path) -> dict[str, str]:
    """The locustfile's settings (KVSERVE_*), this run's only: an optional one this run does
    not set is removed, never inherited from the caller's environment."""
    env = {**os.environ, "KVSERVE_TOKENS_FILE": str(tokens_file), "KVSERVE_SEED": str(cfg.seed),
           "KVSERVE_USERS": str(cfg.users), "KVSERVE_RUN_TIME_S": str(cfg.run_time_s),
           "KVSERVE_TIMEOUT_S": str(cfg.timeout_s), "KVSERVE_PROTOCOL": cfg.protocol}
    for name, value in (("KVSERVE_API_KEY", cfg.api_key), ("KVSERVE_SHAPE", cfg.shape),
                        ("KVSERVE_SPAWN_RATE", cfg.spawn_rate)):
        if value:
            env[name] = str(value)
        else:
            env.pop(name, None)
    return env


def run_locust(cfg: LoadtestConfig) -> LoadtestSummary:
    if cfg.workload not in WORKLOADS:
        raise ValueError(f"--workload {cfg.workload!r}: choose {', '.join(WORKLOADS)}")
    cfg.out.mkdir(parents=True, exist_ok=True)
    tokens_file = cfg.out / "tokens.json"
    start = time.monotonic()
    done = subprocess.run(locust_command(cfg), env=locust_env(cfg, tokens_file),
                          capture_output=True, text=True)
    elapsed = time.monotonic() - start
    (cfg.out / "locust.log").write_text(done.stdout + done.stderr)
    if not (cfg.out / "locust_stats.csv").exists():
        raise RuntimeError(f"locust did not run (exit {done.returncode}):\n{done.stderr[-2000:]}")
    return summarize(cfg, json.loads(tokens_file.read_text()), elapsed)


def summarize(cfg: LoadtestConfig, totals: dict, elapsed_s: float) -> LoadtestSummary:
    """The run's one-screen summary. TTFT, ITL and E2E p50/p99 come from the raw samples the
    locustfile recorded (`totals`), by `kvserve.bench.common.percentile`, so they mean what
    `kvserve bench serve`'s do; Locust's CSV columns (its rounded histogram) are the fallback
    for a totals file without TTFT or ITL samples (its `stream` row mixes in the failed streams,
    so E2E has none)."""
    rows = {r["Name"]: r for r in _read_csv(cfg.out / "locust_stats.csv")}
    stream, ttft, itl = rows.get("stream", {}), rows.get("TTFT", {}), rows.get("ITL", {})
    ttft_ms, itl_ms, e2el_ms = totals.get("ttft_ms"), totals.get("itl_ms"), totals.get("e2el_ms")
    failure_ms = totals.get("failure_ms")  # status -> [ms], one per failed stream
    run_time = min(elapsed_s, cfg.run_time_s) if cfg.run_time_s else elapsed_s
    streams, requests_per_s = _stream_counts(totals, stream)
    return LoadtestSummary(
        users=cfg.users, run_time_s=run_time, streams=streams, requests_per_s=requests_per_s,
        output_tokens=int(totals["output_tokens"]),
        output_tokens_per_s=totals["output_tokens"] / run_time if run_time else 0.0,
        ttft_p50_ms=_quantile(ttft_ms, 50, ttft), ttft_p99_ms=_quantile(ttft_ms, 99, ttft),
        itl_p50_ms=_quantile(itl_ms, 50, itl), itl_p99_ms=_quantile(itl_ms, 99, itl),
        e2el_p50_ms=_quantile(e2el_ms, 50, {}), e2el_p99_ms=_quantile(e2el_ms, 99, {}),
        failures=({status: len(ms) for status, ms in sorted(failure_ms.items())}
                  if failure_ms is not None else _failures(cfg.out / "locust_failures.csv")),
        failure_latency_ms={status: _latency_stats(ms)
                            for status, ms in sorted((failure_ms or {}).items())},
        files=[str(cfg.out / n) for n in ("locust_stats.csv", "locust_stats_history.csv",
                                          "locust_failures.csv", "report.html")])


def run_load(cfg: LoadtestConfig,
             read_rss: Callable[[], dict[str, int]] | None = None) -> LoadtestSummary:
    """One load; with `read_rss` (replica id -> RSS bytes) the replicas' memory and their
    number are watched. The load over time (users, failures, replicas) is plotted in load.png."""
    watch = MemoryWatch(read_rss) if read_rss else nullcontext()
    started_at = time.time()
    with watch:
        summary = run_locust(cfg)
    if read_rss:
        started_at = watch.started_at
        warmup = min(cfg.warmup_s, cfg.run_time_s / 4)
        summary.replica_memory = [m.to_dict() for m in memory_report(watch.samples, warmup)]
        summary.replicas_over_time = [[round(t, 1), n] for t, n in watch.replica_counts]
        ends = json.loads((cfg.out / "tokens.json").read_text()).get("ends", [])
        summary.refusals_by_replicas = refusals_by_replicas(
            [(t - started_at, status) for t, status in ends], summary.replicas_over_time)
        summary.files.append(str(write_csv(watch.samples, cfg.out / "memory.csv")))
        summary.files.append(str(plot_memory(watch.samples, warmup, cfg.out / "memory.png")))
    summary.load_over_time = load_history(cfg.out / "locust_stats_history.csv", started_at)
    if summary.load_over_time:
        summary.files.append(str(plot_load(summary, cfg.out / "load.png")))
    return summary


def refusals_by_replicas(ends: list[tuple[float, str]],
                         replicas: list[list[float]]) -> list[dict]:
    """Each stream's end (t_s, "OK" or its status) counted under the replica count sampled last
    before it (`replicas`: [t_s, count], sorted; ends before the first sample count under it):
    per count, {"replicas", "seconds" at that count, "streams", "refused", "refused_share"}."""
    if not replicas:
        return []
    times = [t for t, _ in replicas]
    rows: dict[int, dict] = {}
    for (t0, n), t1 in zip(replicas, [*times[1:], times[-1]], strict=True):
        row = rows.setdefault(int(n), {"replicas": int(n), "seconds": 0.0, "streams": 0,
                                       "refused": 0})
        row["seconds"] += t1 - t0
    for t, status in ends:
        row = rows[int(replicas[max(0, bisect.bisect_right(times, t) - 1)][1])]
        row["streams"] += 1
        row["refused"] += status in REFUSALS
    return [{**row, "seconds": round(row["seconds"], 1),
             "refused_share": round(row["refused"] / row["streams"], 3) if row["streams"]
             else None} for _, row in sorted(rows.items())]


def load_history(path: Path, started_at: float) -> list[list[float]]:
    """[t_s, users, failures so far] from Locust's history (its "Aggregated" rows, one per
    second), t_s counted from `started_at` (wall clock) as the replica series is."""
    series = []
    for row in _read_csv(path):
        if row.get("Name") != "Aggregated" or (stamp := _number(row.get("Timestamp"))) is None:
            continue
        series.append([round(stamp - started_at, 1), int(_number(row.get("User Count")) or 0),
                       int(_number(row.get("Total Failure Count")) or 0)])
    return series


def plot_load(summary: LoadtestSummary, path: Path) -> Path:
    """Users, failures per second and (given the cluster) replicas over the load: does
    autoscaling follow the load, and do refusals fall as replicas come up?"""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    load = summary.load_over_time
    fig, ax = plt.subplots(figsize=(8, 4))
    ax.plot([t for t, *_ in load], [u for _, u, _ in load], color="tab:blue", label="users")
    rates = [(t1, (f1 - f0) / (t1 - t0)) for (t0, _, f0), (t1, _, f1) in itertools.pairwise(load)
             if t1 > t0]
    ax.plot([t for t, _ in rates], [r for _, r in rates], color="tab:red", alpha=0.7,
            label="failures/s (refusals)")
    ax.set_xlabel("seconds into the load")
    ax.set_ylabel("users, failures/s")
    ax.grid(alpha=0.3)
    lines = ax.get_legend_handles_labels()
    if summary.replicas_over_time:
        right = ax.twinx()
        right.step([t for t, _ in summary.replicas_over_time],
                   [n for _, n in summary.replicas_over_time], where="post", color="tab:green",
                   label="replicas")
        right.set_ylabel("replicas")
        right.set_ylim(0, max(n for _, n in summary.replicas_over_time) + 1)
        more = right.get_legend_handles_labels()
        lines = (lines[0] + more[0], lines[1] + more[1])
    ax.legend(*lines, fontsize=8, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def run_sweep(cfg: LoadtestConfig, user_counts: list[int],
              read_rss: Callable[[], dict[str, int]] | None = None,
              wait_idle: Callable[[], None] = lambda: time.sleep(5)) -> list[LoadtestSummary]:
    """One load per user count, each in `out/users-N/`, the service idle between them (without
    a shape, each starts its users within a second)."""
    summaries = []
    for users in user_counts:
        rate = cfg.spawn_rate if cfg.shape else max(cfg.spawn_rate or SPAWN_RATE, users)
        point = replace(cfg, users=users, spawn_rate=rate, out=cfg.out / f"users-{users}")
        summaries.append(run_load(point, read_rss))
        wait_idle()
    return summaries


def _latency_stats(values_ms: list[float]) -> dict[str, float]:
    """p50, p90, p99 and max of one status's failure latencies, in ms rounded to 0.1: the
    percentiles by `kvserve.bench.common.percentile`, the definition `kvserve bench serve`
    reports with."""
    return {**{f"p{q}": round(percentile(values_ms, q), 1) for q in (50, 90, 99)},
            "max": round(max(values_ms), 1)}


def _quantile(samples: list[float] | None, q: int, locust_row: dict[str, str]) -> float | None:
    """The q-th percentile of `samples` (None when there are none); without samples (None),
    Locust's own column for it."""
    if samples is None:
        return _number(locust_row.get(f"{q}%"))
    return percentile(samples, q) if samples else None


def _read_csv(path: Path) -> list[dict[str, str]]:
    if not path.exists():
        return []
    with path.open() as f:
        return list(csv.DictReader(f))


def _number(text: str | None) -> float | None:
    try:
        return float(text) if text not in (None, "", "N/A") else None
    except ValueError:
        return None


def _stream_counts(totals: dict, stream_row: dict) -> tuple[int, float]:
    """Streams ended (refused ones included) and their rate, from the locustfile's own record
    of every stream's end. Locust writes its CSVs when the run time is up, before the streams
    still running end within its stop timeout: under load its count missed admitted streams
    (one run's CSV said 210 and 7 completed, its own final table 213 and 10). The CSV's row is
    the fallback for a totals file without ends."""
    ends, start = totals.get("ends"), totals.get("start")
    if ends is None or start is None:
        return int(stream_row.get("Request Count", 0)), float(stream_row.get("Requests/s", 0.0))
    span = max((t for t, _ in ends), default=start) - start
    return len(ends), len(ends) / span if span > 0 else 0.0


def _failures(path: Path) -> dict[str, int]:
    out: dict[str, int] = {}
    for row in _read_csv(path):
        match = re.search(r"GrpcStreamError\('?(\w+)'?\)", row.get("Error", ""))
        status = match.group(1) if match else row.get("Error", "?")
        out[status] = out.get(status, 0) + int(row.get("Occurrences", 0))
    return out


def format_summary(s: LoadtestSummary) -> str:
    def ms(value: float | None) -> str:
        return "-" if value is None else f"{value:.0f} ms"

    failures = ", ".join(
        f"{k}={v}" + (f" (p99 {s.failure_latency_ms[k]['p99']:.0f} ms)"
                      if k in s.failure_latency_ms else "")
        for k, v in sorted(s.failures.items())) or "none"
    memory = [f"  replica {m['replica_id']} RSS  {m['start_mib']:.0f} -> {m['warm_mib']:.0f} "
              f"(warm) -> {m['end_mib']:.0f} MiB, {m['growth_after_warmup_pct']:+.1f}% after "
              f"warm-up" for m in s.replica_memory]
    return "\n".join([
        f"kvserve loadtest: {s.users} users, {s.run_time_s:.0f} s",
        f"  streams            {s.streams} ({s.requests_per_s:.2f}/s)",
        f"  output tokens/s    {s.output_tokens_per_s:.1f} ({s.output_tokens} tokens)",
        f"  TTFT p50 / p99     {ms(s.ttft_p50_ms)} / {ms(s.ttft_p99_ms)}",
        f"  ITL p50 / p99      {ms(s.itl_p50_ms)} / {ms(s.itl_p99_ms)}",
        f"  E2E p50 / p99      {ms(s.e2el_p50_ms)} / {ms(s.e2el_p99_ms)} (finished streams)",
        f"  failures           {failures}",
        *memory,
        *([f"  replicas           {_changes(s.replicas_over_time)}"]
          if s.replicas_over_time else []),
        *(["  refused, by replicas serving  " + ", ".join(
            f"{r['replicas']}: {r['refused']}/{r['streams']}" for r in s.refusals_by_replicas)]
          if len(s.refusals_by_replicas) > 1 else []),
        f"  reports            {Path(s.files[0]).parent}/ (locust_*.csv, report.html)",
    ])


def _changes(series: list[list[float]]) -> str:
    """The replica count as it changed: "1 -> 2 (at 34 s) -> 1 (at 95 s)"."""
    steps = [series[0]] + [b for a, b in itertools.pairwise(series) if b[1] != a[1]]
    return " -> ".join(f"{int(n)}" + (f" (at {t:.0f} s)" if i else "")
                       for i, (t, n) in enumerate(steps))
