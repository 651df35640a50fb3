"""`kvserve loadtest` against a real 1-replica deployment over gRPC: 10 s of 8 users
(no failures, Locust's CSV has the TTFT and stream entries, the service's own generated-token
counter agrees with Locust's), and an overload (admission control refuses the excess fast and
leaves nothing behind)."""

from __future__ import annotations

import csv
import json
import subprocess
import time

import pytest

from kvserve.v1 import generation_pb2 as pb
from tests.helpers import poll
from tests.serving import APP, DEFAULT_APP, serve_locally
from tests.test_cli import KVSERVE

pytestmark = pytest.mark.ray  # starts Ray, so also slow (tests/suite_plugin.py)
USES_SHARED_RAY = "1"  # tests/serving.py: run with the modules of this group


def _service_tokens(served) -> dict[str, float]:
    """The service's generated-token counter, per series (labels: one replica's)."""
    return dict(served.metrics().get("ray_kvserve_generation_tokens_total", []))


def _tokens_since(served, before: dict[str, float]) -> float:
    """What the counter grew since `before`, series by series. A series gone since is an
    earlier replica of an app by this name: Ray's metrics agent exports a dead worker's series
    for 120 s more (RAY_WORKER_TIMEOUT_S). Summed over all series, its disappearance mid-test
    takes its tokens off the count (156 of 288 tokens counted, on a loaded host)."""
    return sum(value - before.get(series, 0.0)
               for series, value in _service_tokens(served).items())


def _settled_tokens(served) -> dict[str, float]:
    """The counter once it stops moving. Tokens an earlier test streamed reach Prometheus up
    to ~2 s after they were sent (the metrics agent reports every 1 s, tests/serving.py), and
    counted after `before` they look like this run's: 1,350 tokens against Locust's 1,325 when
    this test runs right after `test_bench_serve.py`'s 3 x 8-token run."""
    last = _service_tokens(served)
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        time.sleep(2.0)
        now = _service_tokens(served)
        if now == last:
            break
        last = now
    return last


def _load_and_count(tmp_path, *flags: str) -> tuple[dict, float]:
    """`kvserve loadtest FLAGS --json` against the shared default app: its summary, and the
    output tokens the service's own metric counted meanwhile (it reaches Prometheus about once
    a second, so it is polled until it agrees or 30 s passed)."""
    with serve_locally(DEFAULT_APP, reuse=True, name=APP) as served:
        before = _settled_tokens(served)
        target = served.http_url if "http" in flags else served.target
        done = subprocess.run([*KVSERVE, "loadtest", "--target", target, *flags, "--out",
                               str(tmp_path), "--json"],
                              capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-3000:]
        summary = json.loads(done.stdout)
        expected = summary["output_tokens"]
        counted = poll(lambda: _tokens_since(served, before),
                       lambda n: abs(n - expected) <= 0.01 * expected, 30, 1.0)
    assert summary["failures"] == {}, summary
    assert summary["output_tokens"] > 0 and summary["ttft_p50_ms"] > 0, summary
    assert abs(counted - expected) <= 0.01 * expected, (counted, expected)
    return summary, counted


def test_10s_of_8_users_fail_nothing_and_count_the_tokens_the_service_counted(tmp_path):
    _load_and_count(tmp_path, "--users", "8", "--spawn-rate", "8", "--run-time", "10s",
                    "--workload", "short")
    rows = {r["Name"]: r for r in csv.DictReader((tmp_path / "locust_stats.csv").open())}
    assert int(rows["TTFT"]["Request Count"]) > 0 and int(rows["stream"]["Request Count"]) > 0
    assert int(rows["stream"]["Failure Count"]) == 0
    assert (tmp_path / "report.html").stat().st_size > 0


def test_http_users_stream_the_openai_api_and_count_the_tokens_the_service_counted(tmp_path):
    """--protocol http: Locust's users stream /v1/chat/completions and /v1/completions through
    Serve's HTTP proxy; every token they count, the service counted too."""
    summary, _ = _load_and_count(tmp_path, "--protocol", "http", "--users", "4",
                                 "--spawn-rate", "4", "--run-time", "5s", "--workload", "mixed")
    assert summary["streams"] > 0 and summary["itl_p50_ms"] > 0


def test_loadtest_help_explains_itself():
    from tests.test_cli import run

    out = run("loadtest", "--help")
    assert out.returncode == 0
    for flag in ("--users", "--spawn-rate", "--run-time", "--workload", "--target", "--out"):
        assert flag in out.stdout


def test_overload_refuses_fast_keeps_the_admitted_and_leaves_nothing_behind(tmp_path):
    """48 users against a replica that runs 4 and queues 4, for 6 s (a 60 s deadline): the 40
    others are refused with RESOURCE_EXHAUSTED, at p90 before the median admitted stream has
    finished and at worst within a quarter of the deadline, nothing else fails, admitted streams
    complete, and afterwards the replica is idle with no KV in use and serves the next request.

    Negative control: a replica that queued every request (an unbounded waiting queue) refuses
    nothing; one that refused only after waiting for a slot would answer a refusal no sooner
    than an admitted stream ends. The bounds are relative to the admitted streams because on a
    loaded 2-core host every stream, admitted or not, stalled ~12 s in one CI run."""
    deadline_s = 60
    # refused by count only, so the first 8 are admitted and complete (with the default
    # max_expected_wait_s, the expected wait at a prompt rate measured under load can refuse
    # some of them too: 6 of 8 complete on a loaded host)
    app = {"kv_cache_memory": "256MiB", "max_num_seqs": 4, "max_waiting_requests": 4,
           "max_expected_wait_s": 600}
    with serve_locally(app, name=APP) as served:  # Locust sends application=kvserve
        done = subprocess.run([*KVSERVE, "loadtest", "--target", served.target, "--users", "48",
                               "--spawn-rate", "48", "--run-time", "6s", "--workload", "short",
                               "--timeout", str(deadline_s), "--out", str(tmp_path), "--json"],
                              capture_output=True, text=True, timeout=900)
        assert done.returncode == 0, done.stderr[-3000:]
        summary = json.loads(done.stdout)
        print(json.dumps(summary))  # pytest shows it if the test fails
        status = _wait_idle(served)
        assert served.stream("Hello", max_tokens=4)[-1].finish_reason == pb.FINISH_REASON_LENGTH
    assert set(summary["failures"]) == {"RESOURCE_EXHAUSTED"}, summary["failures"]
    refused = summary["failure_latency_ms"]["RESOURCE_EXHAUSTED"]
    # each second: [seconds in, users, failures so far] (`kvserve.bench.loadtest.load_history`)
    timeline = summary["load_over_time"][:12]
    # refused, not queued: alone, refusals take ~0.02 s at p50 and ~0.3 s at p99, admitted
    # streams ~2-5 s end to end; a queue (48 users for 4 slots of ~2.5 s streams) gives ~30 s
    assert refused["p90"] < summary["e2el_p50_ms"], (refused, summary["e2el_p50_ms"], timeline)
    assert refused["max"] < 0.25 * deadline_s * 1000, (refused, timeline)
    # every user not admitted was refused (and, if the run time left room, again after its
    # backoff: tests/test_locust_client.py::test_a_refused_user_backs_off_exponentially_...)
    assert summary["failures"]["RESOURCE_EXHAUSTED"] >= 48 - 8, (summary["failures"], timeline)
    # admitted ones finish (within Locust's stop timeout, after the run time)
    completed = summary["streams"] - sum(summary["failures"].values())
    assert completed >= 8 and summary["output_tokens"] > 0, (completed, timeline)
    assert status == {"running": 0, "waiting": 0, "kv_cache_usage": 0}, status


def _wait_idle(served, timeout_s: float = 60) -> dict:
    """The replica's running / waiting / KV gauges once all are 0 (or at the timeout). Read from
    the metrics endpoint, not a handle: a handle in this process leaves a request router behind
    (with its cache-manager lookups) after the cluster is gone."""
    names = {"running": "ray_kvserve_num_requests_running",
             "waiting": "ray_kvserve_num_requests_waiting",
             "kv_cache_usage": "ray_kvserve_kv_cache_usage_perc"}

    def read() -> dict:
        metrics = served.metrics()
        return {k: sum(v for _, v in metrics[name]) if name in metrics else None
                for k, name in names.items()}  # None: not exported yet

    return poll(read, lambda status: all(v == 0 for v in status.values()), timeout_s, 1.0)


def test_without_a_target_it_runs_and_takes_down_its_own_deployment_on_a_new_machine(
        model_dir, tmp_path, monkeypatch, own_ray_head):
    """No --target, an empty HOME (no ~/.ray/auth_token): the local deployment
    starts, serves the load, reports replica memory (a driver on its head's token), and is gone
    afterwards: no state file, no head temp dir, no embedded Redis directory (the Ray head's and
    the Redis processes go with them: tests/test_cli_up.py)."""
    from kvserve.cache_manager.actor import EMBEDDED_PREFIX
    from kvserve.cluster import local_head
    from tests.test_cli_detached import new_user_env

    env = new_user_env(model_dir, tmp_path)
    monkeypatch.setenv("KVSERVE_CACHE_DIR", env["KVSERVE_CACHE_DIR"])
    before = _tmp_dirs(env, local_head.TEMP_PREFIX) | _tmp_dirs(env, EMBEDDED_PREFIX)
    # a deployment `kvserve up` recorded: the load test's own runs beside it, leaving it be
    recorded = local_head.UpState(address="127.0.0.1:9", started_head=False, grpc_port=9)
    local_head.write_state(recorded)
    out = tmp_path / "out"
    done = subprocess.run([*KVSERVE, "loadtest", "--users", "2", "--spawn-rate", "2",
                           "--run-time", "5s", "--warmup", "1s", "--workload", "short",
                           "--out", str(out), "--json"],
                          capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads(done.stdout)
    assert summary["failures"] == {} and summary["output_tokens"] > 0, summary
    assert summary["replica_memory"], summary  # read through the Ray cluster it started
    assert "stopped the Ray head" in done.stdout + done.stderr
    assert local_head.read_state() == recorded
    after = _tmp_dirs(env, local_head.TEMP_PREFIX) | _tmp_dirs(env, EMBEDDED_PREFIX)
    assert after <= before, f"left behind: {after - before}"
    assert not (tmp_path / "home" / ".ray").exists()


def _tmp_dirs(env: dict[str, str], prefix: str) -> set:
    """What the processes run with `env` made in their temp dir (theirs alone:
    tests/test_cli_detached.new_user_env)."""
    from pathlib import Path

    return set(Path(env["TMPDIR"]).glob(f"{prefix}*"))


def test_sigterm_to_its_process_group_while_it_deploys_leaves_nothing_behind(
        model_dir, tmp_path, monkeypatch, own_ray_head):
    """`timeout` (SIGTERM to the whole process group) ending `kvserve loadtest` while
    its local head starts (before Ray's own handler is installed, which would raise SystemExit):
    it exits promptly and its head, temp dir and state file go. A SIGTERM after the load
    started ends in the same `finally` that the run above takes."""
    import os
    import signal
    import time

    from kvserve.cluster import local_head
    from tests.test_cli_detached import new_user_env

    env = new_user_env(model_dir, tmp_path)
    monkeypatch.setenv("KVSERVE_CACHE_DIR", env["KVSERVE_CACHE_DIR"])
    before = _tmp_dirs(env, local_head.TEMP_PREFIX)
    proc = subprocess.Popen([*KVSERVE, "loadtest", "--users", "1", "--run-time", "60s",
                             "--out", str(tmp_path / "out")], env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True)
    try:
        heads = poll(lambda: [d for d in _tmp_dirs(env, local_head.TEMP_PREFIX) - before
                              if (d / "ray-start.log").exists()], bool, 120, 0.05)
        assert heads, "the local head never started"
        [head_dir] = heads
        head_pid = _head_pid(head_dir)
        assert not (head_dir / "ray_current_cluster").exists()  # still starting
        t0 = time.monotonic()
        os.killpg(proc.pid, signal.SIGTERM)
        output = proc.communicate(timeout=60)[0]
        took = time.monotonic() - t0
        assert proc.returncode != 0 and "Traceback" not in output, output[-3000:]
        assert took < 30, f"{took:.1f} s to exit"
        assert not local_head._session_pids(head_pid), "the head outlived loadtest"
        assert not head_dir.exists() and local_head.read_state() is None
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def _head_pid(head_dir) -> int:
    """The `ray start --head` process of the head whose temp dir is `head_dir` (polled: its log
    file is made just before the process starts)."""
    from kvserve.process import pids_with

    pids = poll(lambda: pids_with("start --head", str(head_dir)), bool, 10, 0.02)
    assert len(pids) == 1, f"head processes for {head_dir}: {pids}"
    return pids[0]
