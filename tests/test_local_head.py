"""The Ray head kvserve starts (kvserve/cluster/local_head.py): its own auth token, never
~/.ray/auth_token; tied to its owner when asked (`kvserve up` in the foreground, `kvserve
loadtest`), so that even a SIGKILL of the owner takes it down; and a record of a head that is
gone is forgotten with its temp dir."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from kvserve.cluster import local_head
from tests.helpers import poll

pytestmark = pytest.mark.ray  # starts Ray, so also slow (tests/suite_plugin.py)

OWNER_SCRIPT = textwrap.dedent("""
    import json, sys, time
    from kvserve.cluster import local_head
    state = local_head.start_head(1, fate_share=sys.argv[1] == "1", dashboard=False)
    print(json.dumps({"pid": state.head_pid, "temp_dir": state.temp_dir, "env": state.env,
                      "address": state.address}), flush=True)
    time.sleep(600)
""")


@pytest.mark.parametrize("fate_share", [True, False], ids=["tied", "detached"])
def test_a_tied_head_dies_with_its_owner_even_on_sigkill(fate_share, tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")} | {"HOME": str(home)}
    owner = subprocess.Popen([sys.executable, "-c", OWNER_SCRIPT, "1" if fate_share else "0"],
                             stdout=subprocess.PIPE, text=True, env=env,
                             cwd=Path(__file__).parents[1])
    head = json.loads(owner.stdout.readline())
    try:
        assert local_head._is_head(head["pid"], head["temp_dir"])
        assert head["env"] == {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH":
                               str(Path(head["temp_dir"]) / local_head.TOKEN_FILE)}
        assert not (home / ".ray").exists()  # the head's own token, not ~/.ray/auth_token
        owner.kill()  # SIGKILL: no clean-up of its own runs
        owner.wait()
        # a tied head goes within seconds; the detached one is given 5 s to (wrongly) go
        gone = poll(lambda: local_head._session_pids(head["pid"]), lambda pids: not pids,
                    30 if fate_share else 5, 0.2)
        if fate_share:
            assert not gone, f"head processes outlived their owner: {gone}"
        else:  # the negative control: a detached head stays up for `kvserve down`
            assert local_head._is_head(head["pid"], head["temp_dir"])
    finally:
        owner.kill()
        local_head.stop_head(head["pid"], head["temp_dir"])


def test_the_record_of_a_head_that_is_gone_is_forgotten_with_its_temp_dir(tmp_path,
                                                                           monkeypatch):
    monkeypatch.setenv("KVSERVE_CACHE_DIR", str(tmp_path / "cache"))
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    temp_dir = tmp_path / f"{local_head.TEMP_PREFIX}x"
    temp_dir.mkdir()
    local_head.write_state(local_head.UpState(
        address="127.0.0.1:1", started_head=True, grpc_port=1,
        head_pid=int(gone.stdout), temp_dir=str(temp_dir)))
    assert local_head.read_live_state() is None
    assert local_head.read_state() is None and not temp_dir.exists()
    joined = local_head.UpState(address="127.0.0.1:1", started_head=False, grpc_port=1)
    local_head.write_state(joined)  # a cluster kvserve joined: kept, it cannot tell from here
    assert local_head.read_live_state() == joined
    local_head.remove_state()


def test_a_driver_keeps_the_sigterm_handler_it_had(tmp_path):
    """ray.init and ray.shutdown replace the SIGTERM handler (shutdown's ends the process at
    once): connect_driver / disconnect_driver keep kvserve's, so SIGTERM still cleans up."""
    script = textwrap.dedent("""
        import os, signal, time
        from kvserve.cluster import local_head
        from kvserve.process import sigterm_as_interrupt
        state = local_head.start_head(1, fate_share=True, dashboard=False)
        for stage in ("connected", "disconnected"):
            with sigterm_as_interrupt():
                if stage == "connected":
                    local_head.connect_driver(state.address, state.env)
                else:
                    local_head.disconnect_driver()
                try:
                    os.kill(os.getpid(), signal.SIGTERM)
                    time.sleep(5)
                    print(stage, "not interrupted", flush=True)
                except KeyboardInterrupt:
                    os.kill(os.getpid(), signal.SIGTERM)  # a second one: ignored
                    time.sleep(0.5)
                    print(stage, "interrupted", flush=True)
        local_head.stop_head(state.head_pid, state.temp_dir)
    """)
    home = tmp_path / "home"
    home.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")} | {"HOME": str(home)}
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env,
                         cwd=Path(__file__).parents[1], timeout=180)
    assert out.stdout.split("\n")[:2] == ["connected interrupted", "disconnected interrupted"], (
        out.returncode, out.stdout, out.stderr[-2000:])
    assert out.returncode == 0


def draws(monkeypatch, *ports: int) -> None:
    """The kernel hands out `ports`, in turn, to each bind to port 0."""
    drawn = iter(ports)

    class Drawn:
        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def bind(self, address):
            self.port = next(drawn)

        def getsockname(self):
            return ("127.0.0.1", self.port)

    monkeypatch.setattr(local_head.socket, "socket", Drawn)


def test_free_port_never_hands_out_one_of_rays_default_ports(monkeypatch):
    """Ray's dashboard agent binds 52365 after we pick our ports: a port picked free there
    once failed Serve's gRPC proxy in CI."""
    draws(monkeypatch, 52365, 6379, 40001)
    assert local_head.free_port() == 40001


def test_free_port_is_below_the_kernels_ephemeral_range_and_free():
    """The kernel hands ports of its ephemeral range to connections and binds to port 0 at
    any moment: a port drawn below it stays free until its user binds it, unless that user
    is another explicit bind. Each drawn port binds."""
    low, high = local_head.ephemeral_ports()
    assert 1024 < low < high
    ports = [local_head.free_port() for _ in range(20)]
    assert all(local_head.LOWEST_PORT <= p < low for p in ports), ports
    assert len(set(ports)) > 1  # drawn, not one fixed port
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", ports[0]))


def test_free_port_never_hands_out_a_port_already_taken(monkeypatch):
    """A port picked free and closed can be drawn again before its user binds it."""
    draws(monkeypatch, 40001, 40001, 40002)
    taken: set[int] = set()
    assert [local_head.free_port(taken), local_head.free_port(taken)] == [40001, 40002]
    assert taken == {40001, 40002}
    draws(monkeypatch, 40001)  # negative control: without `taken`, the same port again
    assert local_head.free_port() == 40001


def test_rays_head_never_listens_on_the_ports_serve_will_bind(monkeypatch, tmp_path):
    """A Ray head's GCS may draw the port P of `kvserve up --grpc-port P`, and Serve's gRPC
    proxy then fails to bind. `start` hands its ports to the head as taken. Negative control:
    without them taken, the head's first drawn port is 51221 and the first assertion fails."""
    from kvserve.cli import launch
    from kvserve.cluster.app import AppConfig

    draws(monkeypatch, 51221, 51221, 40001, 40002, 40003, 40004)
    started: list[list[str]] = []

    def popen(cmd, **kwargs):
        started.append(cmd)
        raise OSError("not starting Ray here")

    monkeypatch.setattr(local_head.subprocess, "Popen", popen)
    monkeypatch.setattr(local_head.tempfile, "mkdtemp", lambda prefix: str(tmp_path))
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    with pytest.raises(OSError):
        launch.start(AppConfig(), 51221, fate_share=False, http_port=51222)
    [cmd] = started
    assert not [arg for arg in cmd if arg.endswith(("=51221", "=51222"))], cmd
    assert "--port=40002" in cmd, cmd  # the dashboard's 40001, then the GCS's


def test_local_nodes_share_the_machines_cpus_or_what_the_replicas_need(monkeypatch):
    monkeypatch.setattr(local_head.os, "cpu_count", lambda: 2)
    assert local_head.LocalNodes(1).cpus_per_node(1) == 2  # one head: the whole machine
    assert local_head.LocalNodes(1).cpus_per_node(5) == 5
    assert local_head.LocalNodes(2).cpus_per_node(1) == 1  # its share
    assert local_head.LocalNodes(3).cpus_per_node(3) == 1  # at least one each
    assert local_head.LocalNodes(3).cpus_per_node(6) == 2  # or what the replicas need


def test_a_gpu_config_runs_on_the_cpu_only_on_kvserves_logical_gpus():
    """infra/serve/gpu.yaml on a simulated node: device cuda, flash-attn and a 16 GiB host tier
    become the CPU, the CPU kernels and 512 MiB, and the replica is told what changed. Negative
    controls: a real GPU, no GPU assigned, or GPUs kvserve did not declare (a node with a
    broken driver) leave the config alone, and the engine then fails loudly on CUDA."""
    from kvserve.cluster.deployment import LOGICAL_GPU_HOST_TIER, on_logical_gpus

    gpu = {"device": "cuda", "attention_backend": "flash_attn", "dtype": "bfloat16",
           "cpu_offload_memory": "16GiB", "kv_cache_memory": None}
    used, changed = on_logical_gpus(gpu, ["0"], cuda=False, logical=True)
    assert used == gpu | {"device": "cpu", "attention_backend": "auto",
                          "cpu_offload_memory": LOGICAL_GPU_HOST_TIER}
    assert changed == {"device": ("cuda", "cpu"), "attention_backend": ("flash_attn", "auto"),
                       "cpu_offload_memory": ("16GiB", LOGICAL_GPU_HOST_TIER)}
    for gpu_ids, cuda, logical in ((["0"], True, True), ([], False, True), (["0"], False, False)):
        assert on_logical_gpus(gpu, gpu_ids, cuda, logical) == (gpu, {})
    small = {"device": "auto", "cpu_offload_memory": "64MiB"}  # nothing to give up
    assert on_logical_gpus(small, ["0"], cuda=False, logical=True) == (small, {})
    triton = {"device": "cuda:0", "attention_backend": "triton"}  # kvserve's CUDA kernels
    assert on_logical_gpus(triton, ["0"], cuda=False, logical=True)[1] == {
        "device": ("cuda:0", "cpu"), "attention_backend": ("triton", "auto")}


def test_nodes_can_declare_more_cpus_than_the_machine_has():
    assert local_head.LocalNodes(3, 1, cpus=4).cpus_per_node(3) == 4


@pytest.fixture
def interrupted_popen(monkeypatch) -> list[subprocess.Popen]:
    """`subprocess.Popen` in local_head starts a stand-in with the `ray start` command line (no
    Ray starts), then raises KeyboardInterrupt as a SIGTERM would that lands while Popen waits
    for the child's exec: the caller gets no `proc`. Yields the stand-ins started."""
    started: list[subprocess.Popen] = []
    real_popen = subprocess.Popen

    def popen_then_interrupted(cmd, **kwargs):
        # SIGTERM's default action from before the exec, as `ray start` handles it (a
        # pytest-xdist worker's children inherit it ignored; set inside the stand-in, a SIGTERM
        # that arrives before its interpreter starts is lost)
        kwargs["preexec_fn"] = lambda: signal.signal(signal.SIGTERM, signal.SIG_DFL)
        started.append(real_popen([sys.executable, "-c", "import time; time.sleep(60)", *cmd],
                                  **kwargs))
        raise KeyboardInterrupt  # after the fork and exec, before Popen returns

    monkeypatch.setattr(local_head.subprocess, "Popen", popen_then_interrupted)
    yield started
    for proc in started:
        if proc.poll() is None:
            proc.kill()


def test_an_interrupt_inside_popen_still_stops_the_head_it_started(interrupted_popen):
    """A SIGTERM while the head starts (e.g. to `kvserve loadtest`) leaves no `proc`; the head
    is found by its temp dir and stopped. Negative control: stopping only `proc`'s pid, the
    stand-in outlives the interrupt and `head.wait` times out."""
    with pytest.raises(KeyboardInterrupt):
        local_head.start_head(1, dashboard=False)
    [head] = interrupted_popen
    assert head.wait(timeout=10) is not None  # stopped, not left running
    temp_dir = next(a for a in head.args if a.startswith("--temp-dir=")).split("=", 1)[1]
    assert not Path(temp_dir).exists()


@pytest.fixture
def earlier_node(tmp_path) -> subprocess.Popen:
    """A stand-in for a worker node started before, in the cluster's temp dir `tmp_path`
    (requested before `interrupted_popen`, it starts while Popen is still Popen)."""
    node = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", "ray",
                             "start", f"--temp-dir={tmp_path}", "--dashboard-agent-listen-port=1"])
    yield node
    node.kill()


def test_an_interrupt_inside_popen_still_stops_the_worker_node_it_started(
        earlier_node, interrupted_popen, tmp_path):
    """`kvserve up --local-nodes`: the node being started is found by its temp dir and agent
    port and stopped; a node of the same cluster started before the call is left alone."""
    state = local_head.UpState(address="127.0.0.1:1", started_head=True, grpc_port=0,
                               temp_dir=str(tmp_path))
    with pytest.raises(KeyboardInterrupt):
        local_head.start_worker_nodes(state, 2, num_cpus=1)
    [node] = interrupted_popen
    assert node.wait(timeout=40) is not None  # stopped, not left running
    assert earlier_node.poll() is None
