"""`kvserve up`, then `kvserve generate --target`, then Ctrl-C: as the README describes."""

from __future__ import annotations

import json
import queue
import signal
import subprocess
import threading
import time

from tests.serving import free_port
from tests.test_cli import KVSERVE, run


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


def test_up_generate_target_and_ctrl_c():
    port = free_port()
    proc = subprocess.Popen(
        [*KVSERVE, "up", "--grpc-port", str(port), "--kv-cache-memory", "256MiB"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    try:
        lines = _lines(proc)
        seen = _wait_for(lines, "Ctrl-C to stop", timeout=240)
        assert any(f"127.0.0.1:{port}" in line for line in seen)
        target = f"127.0.0.1:{port}"
        out = run("generate", "The capital of France is", "--target", target,
                  "--max-tokens", "8", "--json")
        assert out.returncode == 0, out.stderr
        result = json.loads(out.stdout)
        assert len(result["token_ids"]) == 8 and result["finish_reason"] == "length"
        assert "Paris" in result["text"]
        bad = run("generate", "hi", "--target", target, "--top-p", "1.5")
        assert bad.returncode == 2
        assert "INVALID_ARGUMENT" in bad.stderr and "top_p" in bad.stderr
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=120) == 0
        _wait_for(lines, "shutting down", timeout=5)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
