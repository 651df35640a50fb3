"""A local Ray head that `kvserve up --detach` starts and `kvserve down` stops, and the state file
that records it (`<kvserve cache dir>/up.json`).

The head runs as `ray start --head --block` in its own session, in a private temp dir: the
temp dir keeps its address out of `/tmp/ray/ray_current_cluster`, so a plain `ray.init()`
elsewhere on the machine never joins it by accident; the session lets `kvserve down` stop
exactly this cluster's processes. (`ray stop` would stop every Ray process on the machine,
other users' clusters included.)
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from workers.loader import cache_root

STATE_FILE = "up.json"
# `ray start` turns on token auth when ~/.ray/auth_token exists; ray.init() as a client only
# sends the token in token mode. So the head and every driver we connect to it agree on it.
AUTH_ENV = {"RAY_AUTH_MODE": "token"}


@dataclass
class UpState:
    address: str  # Ray GCS address, host:port
    started_head: bool  # kvserve started this head; `kvserve down` stops it
    grpc_port: int
    head_pid: int | None = None  # `ray start --block`, leader of the head's session
    temp_dir: str | None = None
    dashboard_url: str | None = None
    env: dict[str, str] | None = None  # environment drivers need to connect

    def head_alive(self) -> bool:
        return self.head_pid is not None and _is_head(self.head_pid, self.temp_dir)


def state_path() -> Path:
    return cache_root() / STATE_FILE


def read_state() -> UpState | None:
    try:
        return UpState(**json.loads(state_path().read_text()))
    except (OSError, ValueError, TypeError):
        return None


def write_state(state: UpState) -> None:
    path = state_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(asdict(state), indent=2))
    tmp.replace(path)


def remove_state() -> None:
    with contextlib.suppress(FileNotFoundError):
        state_path().unlink()


def apply_env(env: dict[str, str] | None) -> None:
    """Make this process a driver that can connect to the recorded head (before ray.init)."""
    if not env:
        return
    os.environ.update(env)
    if "RAY_AUTH_MODE" in env:
        from ray._raylet import Config

        Config.initialize("")  # Ray reads RAY_AUTH_MODE when imported; re-read it (as Ray does)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def num_cpus_for(cpus_needed: float) -> int:
    return max(os.cpu_count() or 1, math.ceil(cpus_needed))


def start_head(num_cpus: int, timeout: float = 120) -> UpState:
    """`ray start --head --block` in its own session; returns once the GCS address is known."""
    ray_bin = Path(sys.executable).with_name("ray")
    temp_dir = tempfile.mkdtemp(prefix="kvserve-ray-")  # short: Ray puts unix sockets here
    dashboard_port = free_port()
    cmd = [
        str(ray_bin), "start", "--head", "--block", "--disable-usage-stats",
        f"--num-cpus={num_cpus}", "--dashboard-host=127.0.0.1",
        f"--dashboard-port={dashboard_port}", f"--port={free_port()}",
        f"--ray-client-server-port={free_port()}",
        f"--dashboard-agent-listen-port={free_port()}", f"--temp-dir={temp_dir}",
    ]
    # a one-node head has nowhere to drain replicas to: stop at once on SIGTERM
    env = os.environ | AUTH_ENV | {"RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "0"}
    env.pop("RAY_ADDRESS", None)
    log = open(Path(temp_dir) / "ray-start.log", "w")  # noqa: SIM115 - handed to the child
    with log:
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log,
                                stderr=subprocess.STDOUT, env=env, start_new_session=True)
    address_file = Path(temp_dir) / "ray_current_cluster"
    deadline = time.monotonic() + timeout
    while not address_file.exists() or not address_file.read_text().strip():
        if proc.poll() is not None or time.monotonic() > deadline:
            tail = (Path(temp_dir) / "ray-start.log").read_text()[-3000:]
            stop_head(proc.pid, temp_dir)
            raise RuntimeError(f"ray start --head failed (exit {proc.poll()}):\n{tail}")
        time.sleep(0.2)
    return UpState(address=address_file.read_text().strip(), started_head=True, grpc_port=0,
                   head_pid=proc.pid, temp_dir=temp_dir,
                   dashboard_url=f"http://127.0.0.1:{dashboard_port}", env=dict(AUTH_ENV))


def stop_head(head_pid: int, temp_dir: str | None, timeout: float = 30) -> None:
    """SIGTERM the `ray start --block` process (it stops its raylet, GCS, dashboard, ...), then
    SIGKILL whatever of its session is left (workers run in process groups of their own)."""
    if _alive(head_pid) and not _is_head(head_pid, temp_dir):
        return  # the pid was reused by someone else: their processes are not ours to stop
    with contextlib.suppress(ProcessLookupError):
        os.kill(head_pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while _alive(head_pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    leftovers = _session_pids(head_pid)
    for pid in leftovers:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while leftovers and time.monotonic() < deadline:
        time.sleep(0.1)
        leftovers = _session_pids(head_pid)
    with contextlib.suppress(ChildProcessError):
        os.waitpid(head_pid, os.WNOHANG)  # reap it if it is our child (stop after a failed up)
    if temp_dir:
        shutil.rmtree(temp_dir, ignore_errors=True)


def _session_pids(sid: int) -> list[int]:
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if os.getsid(int(entry.name)) == sid and _alive(int(entry.name)):
                    pids.append(int(entry.name))
            except (ProcessLookupError, PermissionError):
                continue
    return pids


def _is_head(pid: int, temp_dir: str | None) -> bool:
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return False
    return _alive(pid) and "start --head" in cmdline and (not temp_dir or temp_dir in cmdline)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie is dead
    except (FileNotFoundError, IndexError):
        return False


def reachable(address: str, timeout: float = 2.0) -> bool:
    """Whether something listens at host:port (so ray.init won't spend ~30 s retrying)."""
    if "://" in address:  # ray://, a Ray Client address: let ray.init judge
        return True
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=timeout):
            return True
    except (OSError, ValueError):
        return False
