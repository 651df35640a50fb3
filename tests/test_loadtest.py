"""`kvserve loadtest` (issue #6): 30 s of headless Locust, 8 users streaming over gRPC into a
1-replica local deployment: no failures, TTFT and stream entries in Locust's CSV, and the
service's own generated-token counter agrees with the tokens Locust received."""

from __future__ import annotations

import csv
import json
import subprocess
import time

from tests.serving import serve_locally
from tests.test_cli import KVSERVE


def _service_tokens(served) -> float:
    return sum(v for _, v in served.metrics().get("ray_kvserve_generation_tokens_total", []))


def test_30s_of_8_users_fail_nothing_and_count_the_tokens_the_service_counted(tmp_path):
    with serve_locally({"kv_cache_memory": "512MiB"}) as served:
        before = _service_tokens(served)
        done = subprocess.run([*KVSERVE, "loadtest", "--target", served.target, "--users", "8",
                               "--spawn-rate", "8", "--run-time", "30s", "--workload", "short",
                               "--out", str(tmp_path), "--json"],
                              capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-3000:]
        summary = json.loads(done.stdout)
        deadline, counted = time.monotonic() + 30, 0.0
        while time.monotonic() < deadline:  # metrics reach Prometheus about once a second
            counted = _service_tokens(served) - before
            if abs(counted - summary["output_tokens"]) <= 0.01 * summary["output_tokens"]:
                break
            time.sleep(1)
    assert summary["failures"] == {}, summary
    rows = {r["Name"]: r for r in csv.DictReader((tmp_path / "locust_stats.csv").open())}
    assert int(rows["TTFT"]["Request Count"]) > 0 and int(rows["stream"]["Request Count"]) > 0
    assert int(rows["stream"]["Failure Count"]) == 0
    assert summary["output_tokens"] > 0 and summary["ttft_p50_ms"] > 0
    assert abs(counted - summary["output_tokens"]) <= 0.01 * summary["output_tokens"], (
        counted, summary["output_tokens"])
    assert (tmp_path / "report.html").stat().st_size > 0


def test_loadtest_help_explains_itself():
    from tests.test_cli import run

    out = run("loadtest", "--help")
    assert out.returncode == 0
    for flag in ("--users", "--spawn-rate", "--run-time", "--workload", "--target", "--out"):
        assert flag in out.stdout
