"""`kvserve loadtest`: headless Locust over gRPC or HTTP, one load or a sweep of user counts."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, redirect_stdout
from pathlib import Path
from typing import TYPE_CHECKING

from kvserve.cli.types import positive_float, positive_ints, seconds
from kvserve.workers.config import output_dir

if TYPE_CHECKING:
    from kvserve.cluster.local_head import UpState

DESCRIPTION = """\
Stream Generate over gRPC from Locust users (kvserve.bench.locust), headless, then print
requests/s, output tokens/s, TTFT and ITL p50/p99, failures by gRPC status with how fast they
came, and each replica's resident memory at start, after warm-up and at the end. Locust's CSV
and HTML reports go to --out. Without --target a local 1-replica deployment is started first
(--config to shape it) and stopped afterwards.

Several --users counts (e.g. 1,8,32,64) run one load each and write the baseline: a Markdown
table (baseline.md), a plot of output tokens/s and TTFT against users marking where admission
control starts refusing (baseline.png) and sweep.json.

Soak: --run-time 10m --max-rss-growth 5 exits 1 if any replica's memory grew more than 5%
after --warmup."""


def add_loadtest(sub) -> None:
    p = sub.add_parser("loadtest", help="headless Locust load over gRPC, with a one-screen summary",
                       description=DESCRIPTION, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--users", type=positive_ints, default=[8],
                   help="concurrent users, or a comma list for a sweep (default 8)")
    p.add_argument("--spawn-rate", type=positive_float, default=None,
                   help="users started per second (default 8); with --shape ramp-hold, its\n"
                        "rise (default: up to --users over the first half of the run)")
    p.add_argument("--run-time", type=seconds, default=60.0, help="per load, e.g. 30s, 10m "
                                                                  "(default 60s)")
    p.add_argument("--workload", default="mixed",
                   choices=["short", "long", "mixed", "multiturn", "all"],
                   help="short chat, ~2,000-token prompts, mixed lengths, or multi-turn chats\n"
                        "with shared prefixes (default mixed)")
    p.add_argument("--shape", default=None, choices=["steady", "ramp", "ramp-hold", "spike"],
                   help="load shape over the run: steady (all users throughout), ramp (1 user\n"
                        "up to --users over the run), ramp-hold (up over the first half or at\n"
                        "--spawn-rate, then --users), spike (a quarter, --users in the middle\n"
                        "fifth, a quarter);\n"
                        "default: Locust's own (all users, started at --spawn-rate)")
    p.add_argument("--target", default=None, metavar="HOST:PORT",
                   help="a running deployment (default: start a local one)")
    p.add_argument("--protocol", choices=["grpc", "http"], default="grpc",
                   help="stream over gRPC (default) or the OpenAI-compatible HTTP API (then "
                        "--target is http://HOST:PORT)")
    p.add_argument("--api-key", default=os.environ.get("KVSERVE_API_KEY"),
                   help="the deployment's API key (default $KVSERVE_API_KEY)")
    p.add_argument("--config", default=None, help="AppConfig / Serve config YAML for the local "
                                                  "deployment (default: 1 replica, defaults)")
    p.add_argument("--address", default=None, help="the target's Ray cluster, to read replica "
                                                   "memory (default: RAY_ADDRESS or the local one)")
    p.add_argument("--timeout", type=seconds, default=600.0, help="each stream's gRPC deadline")
    p.add_argument("--warmup", type=seconds, default=60.0,
                   help="memory growth counts from here (at most a quarter of the run)")
    p.add_argument("--max-rss-growth", type=float, default=None, metavar="PCT",
                   help="exit 1 if a replica's memory grew more than PCT%% after warm-up")
    p.add_argument("--seed", type=int, default=0, help="workload seed (default 0)")
    p.add_argument("--out", type=Path, default=output_dir("loadtest"),
                   help="directory for the reports (default: outputs/loadtest in kvserve's "
                        "cache, $KVSERVE_CACHE_DIR or ~/.cache/kvserve)")
    p.add_argument("--json", action="store_true", help="print the summary as one JSON object")
    p.set_defaults(run=run_loadtest)


def run_loadtest(args: argparse.Namespace) -> int:
    from kvserve.bench.loadtest import LoadtestConfig, run_load, run_sweep
    from kvserve.process import sigterm_as_interrupt

    with sigterm_as_interrupt(), _deployment(args) as (target, read_rss, wait_idle):
        if target is None:
            return 1
        cfg = LoadtestConfig(target=target, out=args.out, users=args.users[0],
                             spawn_rate=args.spawn_rate, run_time_s=args.run_time,
                             workload=args.workload, shape=args.shape, seed=args.seed,
                             timeout_s=args.timeout, warmup_s=args.warmup,
                             protocol=args.protocol, api_key=args.api_key)
        if len(args.users) == 1:
            summaries = [run_load(cfg, read_rss)]
        else:
            summaries = run_sweep(cfg, args.users, read_rss, wait_idle)
    _write_reports(args, summaries)
    return _exit_code(args, summaries)


@contextmanager
def _deployment(args: argparse.Namespace) -> Iterator[tuple]:
    """(target, read_rss or None, wait_idle): the given target or a local deployment."""
    from kvserve.cli import status as status_cli
    from kvserve.cluster import local_head

    local = None
    target = args.target
    if target is None:
        with redirect_stdout(sys.stderr):  # its progress; stdout is the summary (--json)
            local = _start_local(args.config)
        if local is None:
            yield None, None, None
            return
        target = (f"http://127.0.0.1:{local.http_port}" if args.protocol == "http"
                  else f"127.0.0.1:{local.grpc_port}")
    try:
        read_rss, wait_idle = _ray_readers(args.address, local)
        yield target, read_rss, wait_idle
    finally:
        local_head.disconnect_driver()
        if local is not None:
            from kvserve.process import signals_ignored

            # no signal may cut the teardown short (after an interrupt they are ignored already)
            with signals_ignored(), redirect_stdout(sys.stderr):
                status_cli.down(None, local)


def _start_local(config: str | None) -> UpState | None:
    """A 1-replica deployment of this run's own, beside any `kvserve up`: a head tied to this
    process (it ends with it, however), not recorded for `kvserve status` / `down`, without the
    Ray dashboard (a headless run; the summary reads replica memory from Ray's GCS). To watch a
    load in the dashboard, `kvserve up --detach` and pass --target."""
    from kvserve.cli.launch import load_config, start
    from kvserve.cluster.local_head import LocalNodes, free_port

    overrides = {} if config else {"replicas": 1}
    return start(load_config(config, overrides), free_port(), fate_share=True, record=False,
                 http_port=free_port(), nodes=LocalNodes(dashboard=False))


def _ray_readers(address: str | None,
                 local: UpState | None = None) -> tuple[Callable | None, Callable[[], None]]:
    """Replica memory and idleness from the status rows, when the Ray cluster is reachable
    (`local`: this run's own deployment)."""
    from kvserve.cli import status as status_cli
    from kvserve.cluster import replica_status
    from kvserve.cluster.memory_watch import replica_rss_from_ray

    try:
        status_cli.connect(address, local)
    except status_cli.NothingRunning as exc:
        print(f"kvserve: replica memory not reported: {exc}", file=sys.stderr)
        return None, lambda: time.sleep(5)

    def wait_idle(timeout_s: float = 120) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            rows = replica_status.read_current().values()
            if rows and all(r.running == r.waiting == 0 for r in rows):
                return
            time.sleep(1)

    return replica_rss_from_ray, wait_idle


def _write_reports(args: argparse.Namespace, summaries: list) -> None:
    from kvserve.bench.loadtest import format_summary

    dicts = [s.to_dict() for s in summaries]
    if len(summaries) == 1:
        (args.out / "summary.json").write_text(json.dumps(dicts[0], indent=2) + "\n")
        print(json.dumps(dicts[0], indent=2) if args.json else format_summary(summaries[0]))
        return
    from kvserve.bench.loadtest_report import baseline_table, plot_baseline

    table = baseline_table(summaries)
    (args.out / "sweep.json").write_text(json.dumps(dicts, indent=2) + "\n")
    (args.out / "baseline.md").write_text(table + "\n")
    plot_baseline(summaries, args.out / "baseline.png",
                  f"kvserve loadtest, {args.workload} workload, {args.run_time:.0f} s per point")
    print(json.dumps(dicts, indent=2) if args.json else
          f"{table}\n\nreports: {args.out}/ (baseline.md, baseline.png, sweep.json, users-N/)")


def _exit_code(args: argparse.Namespace, summaries: list) -> int:
    if args.max_rss_growth is None:
        return 0
    grown = [m for s in summaries for m in s.replica_memory
             if m["growth_after_warmup_pct"] > args.max_rss_growth]
    for m in grown:
        print(f"kvserve: replica {m['replica_id']} memory grew "
              f"{m['growth_after_warmup_pct']:.1f}% after warm-up (limit {args.max_rss_growth}%)",
              file=sys.stderr)
    if not any(s.replica_memory for s in summaries):
        print("kvserve: --max-rss-growth: no replica memory was read", file=sys.stderr)
        return 1
    return 1 if grown else 0
