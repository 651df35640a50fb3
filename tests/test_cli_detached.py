"""`kvserve up --detach -tp 3` -> `kvserve status` -> `kvserve generate --target` -> `kvserve
cache check` -> `kvserve down`, each a subprocess as users run them, on a Ray head that `up
--detach` starts and `down` stops, as a new user runs them: an empty HOME (no
~/.ray/auth_token, no ~/.cache), a fresh cache dir, the default embedded Redis. The replica
splits SmolLM2 over three tensor-parallel ranks (its 9 heads and 3 KV heads divide by 3), and
nothing of them (process, shared memory) outlives `kvserve down`."""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import grpc
import pytest
import redis

from kvserve.cache_manager.actor import EMBEDDED_PREFIX
from kvserve.cache_manager.redis_server import owner_alive
from kvserve.cluster import local_head
from kvserve.process import cmdline, pid_alive
from kvserve.v1 import generation_pb2 as pb
from kvserve.v1 import generation_pb2_grpc as pb_grpc
from tests.helpers import poll
from tests.otlp import CALLER_SPAN_ID, CALLER_TRACE_ID, CALLER_TRACEPARENT, otlp_receiver
from tests.serving import free_port
from tests.test_cli import KVSERVE
from tests.trace_format import trace_format_errors

pytestmark = pytest.mark.ray  # starts Ray, so also slow (tests/suite_plugin.py)


def new_user_env(model_dir: Path, tmp_path: Path) -> dict[str, str]:
    """The environment of a user on a machine that never ran Ray or kvserve: an empty HOME and
    an empty cache dir, except the already-converted model (and the built kernels) linked in.

    Its TMPDIR is its own too (short: Ray's unix sockets live under it), so what this user's
    processes leave in the temp dir (a Ray head's temp dir, an embedded Redis, Ray's record of
    the cluster it started) is theirs alone, whatever else runs on the machine: the tests on the
    other xdist worker, or a cluster `ray start` recorded in /tmp/ray."""
    home, cache = tmp_path / "home", tmp_path / "cache"
    tmp = Path(tempfile.mkdtemp(prefix="kvt", dir="/tmp"))
    atexit.register(shutil.rmtree, tmp, ignore_errors=True)
    home.mkdir()
    cache.mkdir()
    (cache / model_dir.name).symlink_to(model_dir, target_is_directory=True)
    kernels = model_dir.parent / "kernels"
    if kernels.is_dir():
        (cache / "kernels").symlink_to(kernels, target_is_directory=True)
    env = {k: v for k, v in os.environ.items()
           if k not in ("RAY_ADDRESS", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH", "RAY_AUTH_MODE",
                        "REDIS_URL", "KVSERVE_API_KEYS", "KVSERVE_API_KEY")}
    return env | {"HOME": str(home), "KVSERVE_CACHE_DIR": str(cache), "TMPDIR": str(tmp)}


def embedded_redis_dirs(env: dict[str, str], since: float) -> list[Path]:
    """The cache managers' embedded Redis directories in `env`'s temp dir made since `since`
    whose owner lives."""
    return [d for d in Path(env["TMPDIR"]).glob(f"{EMBEDDED_PREFIX}*")
            if d.stat().st_mtime >= since and owner_alive(d)]


def the_embedded_redis_dir(env: dict[str, str], since: float, timeout_s: float = 60) -> Path:
    """The one cache manager's embedded Redis directory made since `since`: the first replica
    starts the manager actor without waiting for it, so it may come a little after the app
    reports ready."""
    dirs = poll(lambda: embedded_redis_dirs(env, since), lambda found: len(found) == 1,
                timeout_s)
    assert len(dirs) == 1, dirs
    return dirs[0]


def dashboard_pids(head_pid: int) -> list[int]:
    """The processes of the Ray dashboard's modules in the head's session (Ray titles them
    `ray-dashboard-<Module>-0`; without the dashboard only a minimal dashboard.py runs)."""
    return [p for p in local_head._session_pids(head_pid)
            if cmdline(p).startswith("ray-dashboard-")]


def dashboard_answers(url: str) -> bool:
    """An HTTP server answers at `url` (any status: the head's dashboard wants its token)."""
    import urllib.error
    import urllib.request

    try:
        urllib.request.urlopen(url, timeout=10).close()
    except urllib.error.HTTPError:
        return True
    except OSError:
        return False
    return True


def redis_server_pids(data_dir: Path) -> list[int]:
    from tests.test_redis_lifetime import _server_pids

    return _server_pids(data_dir)


def test_up_detach_status_generate_down(model_dir, tmp_path, monkeypatch):
    with contextlib.ExitStack() as stack:
        _up_detach_status_generate_down(model_dir, tmp_path, monkeypatch, stack)


def _up_detach_status_generate_down(model_dir, tmp_path, monkeypatch, stack):
    # the replica exports its spans every 0.2 s, not OpenTelemetry's default 5 s (the standard
    # variable, which BatchSpanProcessor reads; the replicas inherit the head's environment)
    env = new_user_env(model_dir, tmp_path) | {"OTEL_BSP_SCHEDULE_DELAY": "200"}
    home = Path(env["HOME"])
    monkeypatch.setenv("KVSERVE_CACHE_DIR", env["KVSERVE_CACHE_DIR"])  # read_state() below

    def kvserve(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
        return subprocess.run([*KVSERVE, *args], capture_output=True, text=True, env=env,
                              timeout=timeout)

    port = free_port()
    namespace = "kvserve:kvserve.Generation:*"
    started = time.time() - 1
    receiver = stack.enter_context(otlp_receiver())  # the replica's spans go here
    try:
        http_port = free_port()
        up = kvserve("up", "--detach", "--grpc-port", str(port), "--kv-cache-memory", "256MiB",
                     "--http-port", str(http_port), "--otlp-traces-endpoint",
                     receiver.endpoint, "-tp", "3")
        assert up.returncode == 0, up.stdout + up.stderr
        assert f"127.0.0.1:{port}" in up.stdout
        assert f"HTTP at http://127.0.0.1:{http_port}/v1" in up.stdout
        assert "WARNING: no API keys" in up.stderr  # an open service says so
        assert "dashboard at http://127.0.0.1:" in up.stdout
        assert "kvserve down" in up.stdout
        state = local_head.read_state()
        assert state is not None and state.started_head and state.head_alive()
        # the dashboard is on by default (tests/test_cli_up.py: --no-dashboard) and answers
        assert dashboard_pids(state.head_pid) and state.dashboard_url
        assert dashboard_answers(state.dashboard_url)
        # the head's own token, in its own state dir, named to every driver: not ~/.ray's
        token = Path(state.env["RAY_AUTH_TOKEN_PATH"])
        assert state.env["RAY_AUTH_MODE"] == "token" and token.parent == Path(state.temp_dir)
        assert token.stat().st_mode & 0o777 == 0o600 and len(token.read_text()) >= 32
        assert f"auth token (dashboard, drivers) in {token}" in up.stdout

        again = kvserve("up", "--detach", "--grpc-port", str(free_port()))
        assert again.returncode == 1 and "already up" in again.stderr

        out = kvserve("status", "--json")
        assert out.returncode == 0, out.stderr
        report = json.loads(out.stdout)
        assert report["application"] == "kvserve" and report["status"] == "RUNNING"
        assert report["grpc_port"] == port
        assert report["deployments"]["Generation"]["replica_states"] == {"RUNNING": 1}
        [replica] = report["replicas"]
        assert replica["state"] == "RUNNING" and replica["pid"] > 0
        # rank 0 in the replica's process, ranks 1 and 2 processes of their own
        assert replica["tensor_parallel_size"] == 3, replica
        ranks = replica["rank_pids"]
        assert len(ranks) == 2 and replica["pid"] not in ranks and all(map(pid_alive, ranks))
        assert replica["running"] == 0 and replica["waiting"] == 0
        assert 0.0 <= replica["kv_cache_usage"] <= 1.0
        # the CPU pool's pages the warm-up wrote, carried apart from the RSS they are part of
        assert 0 < replica["kv_pool_mib"] < replica["rss_mib"], replica

        prompt = " ".join(["The quick brown fox jumps over the lazy dog."] * 8)
        for _ in range(2):  # the second run hits the first one's cached blocks
            gen = kvserve("generate", "--target", f"127.0.0.1:{port}", prompt, "--max-tokens",
                          "4", "--json")
            assert gen.returncode == 0, gen.stderr
            result = json.loads(gen.stdout)
            assert len(result["token_ids"]) == 4 and result["finish_reason"] == "length"
        redis_dir = the_embedded_redis_dir(env, started)  # the cache manager's redis-server
        assert len(redis_server_pids(redis_dir)) == 1
        index = redis.Redis.from_url(f"unix://{redis_dir / 'redis.sock'}")
        keys = set(index.scan_iter(match=namespace))
        assert any(k.endswith(b":blocks:device") for k in keys), keys  # the index is in Redis

        # a caller's trace context crosses Serve's gRPC proxy: its trace holds the request
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            list(pb_grpc.GenerationStub(channel).Generate(
                pb.GenerateRequest(prompt="Hi", params=pb.SamplingParams(max_tokens=2),
                                   request_id="traced"),
                metadata=[("traceparent", CALLER_TRACEPARENT),
                          ("application", "kvserve")]))
        found = poll(lambda: receiver.request_spans().get("traced"), bool, 30, 0.5)
        assert found, "the replica's span never reached the OTLP receiver"
        root, _ = found
        assert root.trace_id.hex() == CALLER_TRACE_ID
        assert root.parent_span_id.hex() == CALLER_SPAN_ID
        assert [s.name for s in receiver.children(root)] == ["queued", "prefill", "decode"]

        check = kvserve("cache", "check")
        assert check.returncode == 0 and "matches every replica" in check.stdout, check.stderr
        traced = kvserve("trace", "--deployment", "--out", str(tmp_path / "trace"), "--json")
        assert traced.returncode == 0, traced.stderr
        [traced_replica] = json.loads(traced.stdout)["replicas"]
        assert traced_replica["steps"] > 0 and traced_replica["requests"] >= 3  # + warm-up
        trace = json.loads((tmp_path / "trace" / "trace.json").read_text())
        assert trace_format_errors(trace) == []
        assert (tmp_path / "trace" / "timeline-0.png").stat().st_size > 10_000
        [replica] = json.loads(kvserve("status", "--json").stdout)["replicas"]
        assert 0.3 < replica["prefix_cache_hit_rate"] <= 0.5  # run 2 hit its full blocks
        assert replica["kv_cached_blocks"] > 0

        table = kvserve("status")
        assert table.returncode == 0, table.stderr
        assert replica["replica_id"] in table.stdout and "PREFIX HIT %" in table.stdout

        down = kvserve("down")
        assert down.returncode == 0, down.stderr
        assert "stopped the Ray head" in down.stdout
        assert "deleted its Redis keys" in down.stdout
        index.close()
        assert local_head.read_state() is None  # no state file left
        assert not local_head._session_pids(state.head_pid), "Ray processes left behind"
        assert not os.path.exists(state.temp_dir)
        assert not redis_server_pids(redis_dir) and not redis_dir.exists(), "Redis left behind"
        assert not (home / ".ray").exists()  # nothing relied on, or wrote, ~/.ray
        assert not [p for p in ranks if pid_alive(p)], "a tensor-parallel rank outlived down"
        segments = [n for n in os.listdir("/dev/shm")
                    if n.startswith((f"kvserve-tp-{replica['pid']}-",
                                     f"kvserve-tp-all-reduce-{replica['pid']}-"))]
        assert not segments, segments

        gone = kvserve("status")
        assert gone.returncode == 1
        assert "nothing deployed" in gone.stderr and "Traceback" not in gone.stderr
        again_down = kvserve("down")
        assert again_down.returncode == 1 and "nothing running" in again_down.stderr
        bad = kvserve("deploy", "--replicas", "0")  # checked before anything else
        assert bad.returncode == 2 and "replicas" in bad.stderr, bad.stderr
        assert "Traceback" not in bad.stderr
        nowhere = kvserve("deploy", "--replicas", "2")  # nothing to apply it to: one line
        assert nowhere.returncode == 1 and nowhere.stderr.startswith("kvserve: "), nowhere.stderr
        assert "Traceback" not in nowhere.stderr
    finally:
        leftover = local_head.read_state()
        if leftover is not None and leftover.started_head and leftover.head_pid:
            local_head.stop_head(leftover.head_pid, leftover.temp_dir)
            local_head.remove_state()


def test_help_explains_detach_status_and_down():
    from tests.test_cli import run

    up = run("up", "--help")
    assert up.returncode == 0 and "--detach" in up.stdout and "kvserve down" in up.stdout
    deploy = run("deploy", "--help")
    assert deploy.returncode == 0 and "serve deploy" in deploy.stdout
    assert "--config" in deploy.stdout and "--max-num-seqs" in deploy.stdout  # every setting
    for command in ("status", "down", "cache check", "deploy"):
        out = run(*command.split(), "--help")
        assert out.returncode == 0 and "--address" in out.stdout, out.stderr
    assert "--json" in run("status", "--help").stdout
