"""A local Ray head that `kvserve up --detach` starts and `kvserve down` stops, and the state file
that records it (`<kvserve cache dir>/up.json`).

The head runs as `ray start --head --block` in its own session, in a private temp dir: the
temp dir keeps its address out of `/tmp/ray/ray_current_cluster`, so a plain `ray.init()`
elsewhere on the machine never joins it by accident; the session lets `kvserve down` stop
exactly this cluster's processes. (`ray stop` would stop every Ray process on the machine,
other users' clusters included.)

The head uses Ray's token authentication (it listens on ports) with a token kvserve makes for
it: a file in the head's own temp dir, named to the head and to every driver through
`RAY_AUTH_TOKEN_PATH` (recorded in the state file). Nothing depends on `~/.ray/auth_token`, so
the first command on a machine that has never run Ray works.

A head started for the caller's lifetime only (`kvserve up` in the foreground, `kvserve
loadtest`'s local deployment) is tied to it with a parent-death signal: however the caller
dies, even by SIGKILL, the head gets SIGTERM and takes its processes with it.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import random
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from kvserve.cluster.http_ingress import PROXY_CALLBACK, PROXY_CALLBACK_ENV
from kvserve.cluster.ray_compat import (
    NO_WORKER_PRESTART_ENV,
    reload_auth_config,
    sigterm_handler_kept,
)
from kvserve.process import cmdline, die_with_parent, pid_alive, pids_with
from kvserve.workers.config import cache_root

STATE_FILE = "up.json"
# "1" on the nodes kvserve starts with GPUs it declared (`--gpus-per-node`): where CUDA is absent
# they are logical, and a replica there runs a GPU config on the CPU (kvserve/cluster/deployment.py)
LOGICAL_GPUS_ENV = "KVSERVE_LOGICAL_GPUS"
TOKEN_FILE = "auth_token"  # in the head's temp dir, mode 0600
TEMP_PREFIX = "kvserve-ray-"  # the head's temp dir: short, Ray puts unix sockets there


@dataclass
class UpState:
    address: str  # Ray GCS address, host:port
    started_head: bool  # kvserve started this head; `kvserve down` stops it
    grpc_port: int
    http_port: int | None = None  # the OpenAI-compatible API (Serve's HTTP proxy)
    head_pid: int | None = None  # `ray start --block`, leader of the head's session
    temp_dir: str | None = None
    dashboard_url: str | None = None
    env: dict[str, str] | None = None  # environment drivers need to connect (auth token)
    # `kvserve up --local-nodes N`: the worker nodes' `ray start --block` processes
    node_pids: list[int] = field(default_factory=list)

    def head_alive(self) -> bool:
        return self.head_pid is not None and _is_head(self.head_pid, self.temp_dir)


def state_path() -> Path:
    return cache_root() / STATE_FILE


def read_state() -> UpState | None:
    try:
        return UpState(**json.loads(state_path().read_text()))
    except (OSError, ValueError, TypeError):
        return None


def read_live_state() -> UpState | None:
    """The recorded deployment, unless kvserve started its head and the head is gone (killed
    with its owner, a reboot): then the record and the head's temp dir are removed."""
    state = read_state()
    if state is None or not state.started_head or state.head_alive():
        return state
    remove_state()
    if state.temp_dir and Path(state.temp_dir).name.startswith(TEMP_PREFIX):
        shutil.rmtree(state.temp_dir, ignore_errors=True)
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


def auth_env(temp_dir: str) -> dict[str, str]:
    """Token mode, with the token in the head's own temp dir (written by `write_token`)."""
    return {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(Path(temp_dir) / TOKEN_FILE)}


def write_token(temp_dir: str) -> None:
    path = Path(temp_dir) / TOKEN_FILE
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(32))


def apply_env(env: dict[str, str] | None) -> None:
    """Make this process a driver that can connect to the recorded head (before ray.init)."""
    if not env:
        return
    if "RAY_AUTH_TOKEN_PATH" in env:
        os.environ.pop("RAY_AUTH_TOKEN", None)  # it would win over the head's own token file
    os.environ.update(env)
    if "RAY_AUTH_MODE" in env:
        reload_auth_config()  # Ray read RAY_AUTH_MODE when imported, and may have cached a token


def connect_driver(address: str, env: dict[str, str] | None = None, **init_kwargs: Any) -> Any:
    """`ray.init` as a driver of the cluster at `address` (with a recorded head's `env`),
    keeping this process's SIGTERM handler. Returns Ray's context."""
    import ray

    apply_env(env)
    with sigterm_handler_kept():
        return ray.init(address=address, log_to_driver=False, **init_kwargs)


def disconnect_driver() -> None:
    """`ray.shutdown`, keeping this process's SIGTERM handler."""
    import ray

    if ray.is_initialized():
        with sigterm_handler_kept():
            ray.shutdown()


# Ray's fixed default ports (GCS, dashboard, client server, dashboard agent): Ray's processes
# bind them after a caller picked its ports, so a port picked free may not stay free. The agent's
# 52365 lies in Linux's ephemeral range: drawn for Serve's gRPC proxy, it would fail to bind.
RAY_DEFAULT_PORTS = frozenset({6379, 8265, 10001, 52365})
_RANDOM = random.SystemRandom()  # not the process's seeded `random`: two tests' draws differ


# below: well-known services' (Redis 6379, Ray's dashboard 8265) and Ray's worker ports
# (10002-19999, which `ray start` refuses to see given to anything else)
LOWEST_PORT = 20000


def ephemeral_ports() -> tuple[int, int]:
    """The kernel's range for ports it picks itself (an outgoing connection's, a bind to port
    0): Linux's ip_local_port_range, 32768-60999 by default."""
    try:
        low, high = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    except (OSError, ValueError):
        return 32768, 60999
    return low, high


def free_port(taken: set[int] | None = None) -> int:
    """A port free on loopback now, never one of Ray's own defaults nor one in `taken`: ports
    already handed out but not bound yet, which the kernel may draw again (the GCS could draw
    the gRPC port the caller has picked). The port is added to `taken`.

    Drawn at random below the kernel's ephemeral range: a port picked free and not bound yet
    is otherwise the kernel's to hand out, and the many connections Ray's processes and a
    tensor-parallel replica's ranks open take ports from that range (one took a Serve gRPC
    proxy's port in CI between the pick and the bind)."""
    taken = set() if taken is None else taken
    low = ephemeral_ports()[0]
    while True:
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1",
                        _RANDOM.randrange(LOWEST_PORT, low) if low > LOWEST_PORT + 1000 else 0))
            except OSError:  # in use: another draw
                continue
            port = s.getsockname()[1]
        if port not in RAY_DEFAULT_PORTS and port not in taken:
            taken.add(port)
            return port


def num_cpus_for(cpus_needed: float) -> int:
    return max(os.cpu_count() or 1, math.ceil(cpus_needed))


@dataclass(frozen=True)
class LocalNodes:
    """The Ray nodes `kvserve up` starts on this machine: a head and `count - 1` worker nodes,
    each declaring `gpus_per_node` GPUs (logical where the machine has none: everything above
    the device runs as on a GPU cluster) and its share of the CPUs."""

    count: int = 1
    gpus_per_node: int = 0
    cpus: int | None = None  # CPUs each node declares (logical too); None: as below
    # the Ray dashboard on the head: its modules run as ten processes of their own, ~5 CPU-s
    # and ~3 s of the head's start on a 2-core machine (`kvserve up --no-dashboard` skips it)
    dashboard: bool = True

    def cpus_per_node(self, cpus_needed: float) -> int:
        """`cpus` if given; else the head alone gets the machine (or what the replicas need);
        with several nodes, each gets its share of the machine's CPUs, or of what the replicas
        need."""
        if self.cpus is not None:
            return self.cpus
        if self.count == 1:
            return num_cpus_for(cpus_needed)
        return max(1, (os.cpu_count() or 1) // self.count, math.ceil(cpus_needed / self.count))


def start_head(num_cpus: int, timeout: float = 120, fate_share: bool = False,
               num_gpus: int = 0, dashboard: bool = True,
               taken: set[int] | None = None) -> UpState:
    """`ray start --head --block` in its own session; returns once the GCS address is known.

    `fate_share`: the head gets SIGTERM when the calling thread ends, as it does when this
    process dies, however it dies (call it from the main thread). `num_gpus`: the GPUs it
    declares (logical ones where the machine has fewer: Ray schedules them all the same).
    `dashboard`: the Ray dashboard, on loopback (without it, each node's agent still exports
    metrics to Prometheus). `taken`: ports the caller already chose (Serve's gRPC and HTTP),
    which Ray's processes must not draw; the ports picked here are added to it."""
    ray_bin = Path(sys.executable).with_name("ray")
    temp_dir = tempfile.mkdtemp(prefix=TEMP_PREFIX)
    write_token(temp_dir)
    taken = set() if taken is None else taken
    dashboard_port = free_port(taken)
    cmd = [
        str(ray_bin), "start", "--head", "--block", "--disable-usage-stats",
        f"--num-cpus={num_cpus}", f"--port={free_port(taken)}",
        *(["--dashboard-host=127.0.0.1", f"--dashboard-port={dashboard_port}"] if dashboard
          else ["--include-dashboard=false"]),
        f"--ray-client-server-port={free_port(taken)}",
        f"--dashboard-agent-listen-port={free_port(taken)}", f"--temp-dir={temp_dir}",
        *([f"--num-gpus={num_gpus}"] if num_gpus else []),
    ]
    # a one-node head has nowhere to drain replicas to: stop at once on SIGTERM
    env = os.environ | auth_env(temp_dir) | {"RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "0",
                                              PROXY_CALLBACK_ENV: PROXY_CALLBACK}
    if num_gpus:
        env[LOGICAL_GPUS_ENV] = "1"
    env |= NO_WORKER_PRESTART_ENV  # kvserve runs actors, whose workers start on demand anyway
    for name in ("RAY_ADDRESS", "RAY_AUTH_TOKEN"):
        env.pop(name, None)
    log = open(Path(temp_dir) / "ray-start.log", "w")  # noqa: SIM115 - handed to the child
    address_file = Path(temp_dir) / "ray_current_cluster"
    deadline = time.monotonic() + timeout
    proc = None
    try:
        with log:
            proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log,
                                    stderr=subprocess.STDOUT, env=env, start_new_session=True,
                                    preexec_fn=die_with_parent() if fate_share else None)
        while not address_file.exists() or not address_file.read_text().strip():
            if proc.poll() is not None or time.monotonic() > deadline:
                tail = (Path(temp_dir) / "ray-start.log").read_text()[-3000:]
                raise RuntimeError(f"ray start --head failed (exit {proc.poll()}):\n{tail}")
            time.sleep(0.2)
    except BaseException:  # a failure, or an interrupt (Ctrl-C, SIGTERM) while it starts
        # An interrupt inside Popen, after the child exec'd but before Popen returned (the
        # parent still waiting to be scheduled on a busy host), leaves no `proc`: the
        # head is found by its temp dir.
        heads = [proc.pid] if proc is not None else pids_with("start --head", temp_dir)
        for pid in heads:
            stop_head(pid, temp_dir)
        shutil.rmtree(temp_dir, ignore_errors=True)
        raise
    return UpState(address=address_file.read_text().strip(), started_head=True, grpc_port=0,
                   head_pid=proc.pid, temp_dir=temp_dir,
                   dashboard_url=f"http://127.0.0.1:{dashboard_port}" if dashboard else None,
                   env=auth_env(temp_dir))


def start_worker_nodes(state: UpState, count: int, num_cpus: int, num_gpus: int = 0,
                       timeout: float = 120, fate_share: bool = False,
                       taken: set[int] | None = None) -> list[int]:
    """`count` more nodes of the head's cluster on this machine (`kvserve up --local-nodes`):
    each a `ray start --address --block` in its own session, with its own raylet, `num_cpus`
    CPUs and `num_gpus` (logical) GPUs, sharing the head's temp dir and auth token. Returns
    their pids once each says it started (`stop_head(..., node_pids=...)` stops them).
    `taken`: as `start_head`'s.

    One after the other: raylets started at the same moment on one machine can pick the same
    free port for one of their agents, and the loser never registers (Ray gives up after 30 s)."""
    ray_bin = Path(sys.executable).with_name("ray")
    env = os.environ | auth_env(state.temp_dir) | {PROXY_CALLBACK_ENV: PROXY_CALLBACK}
    for name in ("RAY_ADDRESS", "RAY_AUTH_TOKEN"):
        env.pop(name, None)
    if num_gpus:
        env[LOGICAL_GPUS_ENV] = "1"
    env |= NO_WORKER_PRESTART_ENV  # more CPUs declared than the machine has
    taken = set() if taken is None else taken
    pids: list[int] = []
    starting: tuple[str, str] | None = None
    deadline = time.monotonic() + timeout
    try:
        for i in range(count):
            # the temp dir and agent port name this node's process (no other node has both)
            marks = (f"--temp-dir={state.temp_dir}",
                     f"--dashboard-agent-listen-port={free_port(taken)}")
            # no log monitor: the nodes share the head's session directory, whose log files
            # the head's monitor already sends to drivers; one per node sent every line of
            # every process once per node (Ray: one log monitor per physical host)
            cmd = [str(ray_bin), "start", f"--address={state.address}", "--block",
                   "--disable-usage-stats", f"--num-cpus={num_cpus}", f"--num-gpus={num_gpus}",
                   *marks, f"--metrics-export-port={free_port(taken)}",
                   "--include-log-monitor=false"]
            log = Path(state.temp_dir) / f"ray-start-node-{i + 1}.log"
            starting = marks  # until Popen returns its pid
            with open(log, "w") as out:
                proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=out,
                                        stderr=subprocess.STDOUT, env=env,
                                        start_new_session=True,
                                        preexec_fn=die_with_parent() if fate_share else None)
            pids.append(proc.pid)
            starting = None
            while "Ray runtime started" not in log.read_text():
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"ray start --address failed (exit {proc.poll()}):\n"
                                       f"{log.read_text()[-3000:]}")
                time.sleep(0.2)
    except BaseException:
        if starting is not None:  # interrupted inside Popen (as start_head can be)
            pids += pids_with(*starting)
        _stop_sessions(pids, state.temp_dir)
        raise
    return pids


def _stop_sessions(pids: list[int], temp_dir: str | None, timeout: float = 30) -> None:
    """SIGTERM each `ray start --block` of ours, then SIGKILL what is left of its session."""
    ours = [p for p in pids if pid_alive(p) and _is_ray_start(p, temp_dir)]
    for pid in ours:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while any(pid_alive(p) for p in ours) and time.monotonic() < deadline:
        time.sleep(0.2)
    for pid in pids:
        for left in _session_pids(pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(left, signal.SIGKILL)
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, os.WNOHANG)


def stop_head(head_pid: int, temp_dir: str | None, timeout: float = 30,
              node_pids: list[int] | None = None) -> None:
    """SIGTERM the `ray start --block` process (it stops its raylet, GCS, dashboard, ...), then
    SIGKILL whatever of its session is left (workers run in process groups of their own).
    `node_pids`: worker nodes kvserve started beside it (`--local-nodes`), stopped first."""
    if node_pids:
        _stop_sessions(node_pids, temp_dir)
    if pid_alive(head_pid) and not _is_head(head_pid, temp_dir):
        return  # the pid was reused by someone else: their processes are not ours to stop
    with contextlib.suppress(ProcessLookupError):
        os.kill(head_pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while pid_alive(head_pid) and time.monotonic() < deadline:
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
                if os.getsid(int(entry.name)) == sid and pid_alive(int(entry.name)):
                    pids.append(int(entry.name))
            except (ProcessLookupError, PermissionError):
                continue
    return pids


def _is_head(pid: int, temp_dir: str | None) -> bool:
    line = cmdline(pid)
    return pid_alive(pid) and "start --head" in line and (not temp_dir or temp_dir in line)


def _is_ray_start(pid: int, temp_dir: str | None) -> bool:
    """A `ray start` (head or worker node) of ours: not a reused pid."""
    line = cmdline(pid)
    return "ray" in line and " start " in line and (not temp_dir or temp_dir in line)


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
