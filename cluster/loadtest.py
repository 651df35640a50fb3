"""`kvserve loadtest`: headless Locust over gRPC against a deployment, with a one-screen summary.

Runs `infra/locust/locustfile.py` in its own process (gevent stays out of ours), writes Locust's
CSV and HTML reports to `--out`, and summarises them: requests/s, output tokens/s, TTFT and ITL
p50/p99, failures by gRPC status. Without `--target` it starts a local deployment first
(`kvserve up --detach`) and stops it afterwards (`kvserve down`).
"""

from __future__ import annotations

import csv
import json
import os
import re
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

LOCUSTFILE = Path(__file__).resolve().parents[1] / "infra" / "locust" / "locustfile.py"
WORKLOADS = {"short": ["ShortChatUser"], "long": ["LongPromptUser"], "mixed": ["MixedUser"],
             "multiturn": ["MultiTurnUser"],
             "all": ["ShortChatUser", "LongPromptUser", "MixedUser", "MultiTurnUser"]}


@dataclass
class LoadtestConfig:
    target: str
    out: Path
    users: int = 8
    spawn_rate: float = 8.0
    run_time_s: float = 60.0
    workload: str = "mixed"
    shape: str | None = None  # steady | ramp | spike; None: Locust's own (all users, whole run)
    seed: int = 0


@dataclass
class LoadtestSummary:
    users: int
    run_time_s: float
    streams: int
    requests_per_s: float
    output_tokens: int
    output_tokens_per_s: float
    ttft_p50_ms: float | None
    ttft_p99_ms: float | None
    itl_p50_ms: float | None
    itl_p99_ms: float | None
    failures: dict[str, int] = field(default_factory=dict)  # gRPC status -> count
    files: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)


def locust_command(cfg: LoadtestConfig) -> list[str]:
    prefix = cfg.out / "locust"
    return [sys.executable, "-m", "locust", "-f", str(LOCUSTFILE), "--headless",
            "--host", cfg.target, "-u", str(cfg.users), "-r", str(cfg.spawn_rate),
            "-t", f"{int(cfg.run_time_s)}s", "--stop-timeout", "120", "--csv", str(prefix),
            "--html", str(cfg.out / "report.html"), "--only-summary", *WORKLOADS[cfg.workload]]


def run_locust(cfg: LoadtestConfig) -> LoadtestSummary:
    if cfg.workload not in WORKLOADS:
        raise ValueError(f"--workload {cfg.workload!r}: choose {', '.join(WORKLOADS)}")
    cfg.out.mkdir(parents=True, exist_ok=True)
    tokens_file = cfg.out / "tokens.json"
    env = {**os.environ, "KVSERVE_TOKENS_FILE": str(tokens_file), "KVSERVE_SEED": str(cfg.seed),
           "KVSERVE_USERS": str(cfg.users), "KVSERVE_RUN_TIME_S": str(cfg.run_time_s)}
    if cfg.shape:
        env["KVSERVE_SHAPE"] = cfg.shape
    start = time.monotonic()
    done = subprocess.run(locust_command(cfg), env=env, capture_output=True, text=True)
    elapsed = time.monotonic() - start
    (cfg.out / "locust.log").write_text(done.stdout + done.stderr)
    if not (cfg.out / "locust_stats.csv").exists():
        raise RuntimeError(f"locust did not run (exit {done.returncode}):\n{done.stderr[-2000:]}")
    return summarize(cfg, json.loads(tokens_file.read_text()), elapsed)


def summarize(cfg: LoadtestConfig, totals: dict, elapsed_s: float) -> LoadtestSummary:
    rows = {r["Name"]: r for r in _read_csv(cfg.out / "locust_stats.csv")}
    stream, ttft, itl = rows.get("stream", {}), rows.get("TTFT", {}), rows.get("ITL", {})
    run_time = min(elapsed_s, cfg.run_time_s) if cfg.run_time_s else elapsed_s
    return LoadtestSummary(
        users=cfg.users, run_time_s=run_time, streams=int(stream.get("Request Count", 0)),
        requests_per_s=float(stream.get("Requests/s", 0.0)),
        output_tokens=int(totals["output_tokens"]),
        output_tokens_per_s=totals["output_tokens"] / run_time if run_time else 0.0,
        ttft_p50_ms=_number(ttft.get("50%")), ttft_p99_ms=_number(ttft.get("99%")),
        itl_p50_ms=_number(itl.get("50%")), itl_p99_ms=_number(itl.get("99%")),
        failures=_failures(cfg.out / "locust_failures.csv"),
        files=[str(cfg.out / n) for n in ("locust_stats.csv", "locust_stats_history.csv",
                                          "locust_failures.csv", "report.html")])


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

    failures = ", ".join(f"{k}={v}" for k, v in sorted(s.failures.items())) or "none"
    return "\n".join([
        f"kvserve loadtest: {s.users} users, {s.run_time_s:.0f} s",
        f"  streams            {s.streams} ({s.requests_per_s:.2f}/s)",
        f"  output tokens/s    {s.output_tokens_per_s:.1f} ({s.output_tokens} tokens)",
        f"  TTFT p50 / p99     {ms(s.ttft_p50_ms)} / {ms(s.ttft_p99_ms)}",
        f"  ITL p50 / p99      {ms(s.itl_p50_ms)} / {ms(s.itl_p99_ms)}",
        f"  failures           {failures}",
        f"  reports            {Path(s.files[0]).parent}/ (locust_*.csv, report.html)",
    ])
