"""`kvserve up` in the foreground, then `kvserve generate --target` and `kvserve status`, then
SIGTERM to its whole process group (as `timeout` and process managers send it, and as Ctrl-C
sends SIGINT): it shuts down promptly and leaves nothing behind. Run as a new user: an empty
HOME and cache dir (tests/test_cli_detached.py)."""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import threading
import time

import pytest

from kvserve.cluster import local_head
from tests.serving import free_port
from tests.test_cli import KVSERVE
from tests.test_cli_detached import (
    dashboard_pids,
    new_user_env,
    redis_server_pids,
    the_embedded_redis_dir,
)

pytestmark = pytest.mark.ray  # starts Ray, so also slow (tests/suite_plugin.py)


def _lines(proc: subprocess.Popen) -> queue.Queue:
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [lines.put(x) for x in proc.stdout], daemon=True).start()
    return lines


def _wait_for(lines: queue.Queue, needle: str, timeout: float) -> list[str]:
    seen, deadline = [], time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            seen.append(lines.get(timeout=1))
        except queue.Empty:
            continue
        if needle in seen[-1]:
            return seen
    raise AssertionError(f"no {needle!r} within {timeout}s; output: {''.join(seen)[-2000:]}")


def test_up_generate_status_and_sigterm_to_its_process_group(model_dir, tmp_path, monkeypatch):
    env = new_user_env(model_dir, tmp_path)
    monkeypatch.setenv("KVSERVE_CACHE_DIR", env["KVSERVE_CACHE_DIR"])  # read_state() below
    port, http_port = free_port(), free_port()
    started = time.time() - 1
    proc = subprocess.Popen(
        [*KVSERVE, "up", "--grpc-port", str(port), "--http-port", str(http_port),
         "--kv-cache-memory", "256MiB", "--api-key", "sk-test:team", "--no-dashboard"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
        start_new_session=True,  # its own process group, so the test can signal all of it
    )

    def kvserve(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([*KVSERVE, *args], capture_output=True, text=True, env=env,
                              timeout=300)

    state = None
    try:
        lines = _lines(proc)
        seen = _wait_for(lines, "Ctrl-C to stop", timeout=240)
        assert any(f"127.0.0.1:{port}" in line for line in seen)
        state = local_head.read_state()
        assert state is not None and state.started_head and state.head_alive()
        # --no-dashboard: no dashboard process, no URL (tests/test_cli_detached.py: the default)
        assert not dashboard_pids(state.head_pid) and state.dashboard_url is None
        assert not any("kvserve: Ray dashboard at" in line for line in seen), seen
        redis_dir = the_embedded_redis_dir(env, started)
        assert not any("no API keys" in line for line in seen)  # keys given: no warning
        target, http = f"127.0.0.1:{port}", f"http://127.0.0.1:{http_port}"
        out = kvserve("generate", "The capital of France is", "--target", target,
                      "--max-tokens", "8", "--json", "--api-key", "sk-test")
        assert out.returncode == 0, out.stderr
        result = json.loads(out.stdout)
        assert len(result["token_ids"]) == 8 and result["finish_reason"] == "length"
        assert "Paris" in result["text"]
        # the same greedy tokens over the OpenAI-compatible HTTP API
        over_http = kvserve("generate", "The capital of France is", "--target", http,
                            "--max-tokens", "8", "--json", "--api-key", "sk-test")
        assert over_http.returncode == 0, over_http.stderr
        assert json.loads(over_http.stdout)["token_ids"] == result["token_ids"]
        for where in (target, http):
            refused = kvserve("generate", "hi", "--target", where)  # no key
            assert refused.returncode == 1
            assert "UNAUTHENTICATED" in refused.stderr or "401" in refused.stderr
            bad = kvserve("generate", "hi", "--target", where, "--top-p", "1.5",
                          "--api-key", "sk-test")
            assert bad.returncode == 2 and "top_p" in bad.stderr, bad.stderr
        assert "INVALID_ARGUMENT" in bad.stderr or "400" in bad.stderr
        status = kvserve("status", "--json")  # the foreground deployment is recorded too
        assert status.returncode == 0, status.stderr
        assert json.loads(status.stdout)["grpc_port"] == port

        t0 = time.monotonic()
        os.killpg(proc.pid, signal.SIGTERM)  # once, to the whole group, as `timeout` sends it
        assert proc.wait(timeout=60) == 0
        took = time.monotonic() - t0
        _wait_for(lines, "shutting down", timeout=5)
        _wait_for(lines, "stopped the Ray head", timeout=5)
        assert took < 30, f"{took:.1f} s to shut down"
        assert local_head.read_state() is None  # no state file left
        assert not local_head._session_pids(state.head_pid), "Ray processes left behind"
        assert not os.path.exists(state.temp_dir)
        assert not redis_server_pids(redis_dir) and not redis_dir.exists(), "Redis left behind"
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        if state is not None and state.head_alive():
            local_head.stop_head(state.head_pid, state.temp_dir)
