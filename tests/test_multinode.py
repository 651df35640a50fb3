"""Many nodes, simulated: one cluster for the module, `kvserve up --detach --local-nodes 3
--gpus-per-node 1`: a head and two worker nodes on this machine, separate raylets, each
declaring one logical GPU; three replicas with one GPU each, the real model.

In order, on that cluster:
- placement: three replicas on three distinct nodes and GPUs, each saying once that its GPU is
  only logical and serving on the CPU; the cache manager on the head;
- routing: 8 chats x 5 turns stay on the replica holding their history, across nodes;
- node failure: SIGKILL a worker node while clients stream: its streams end UNAVAILABLE, its
  replica's index entries vanish within the lease, new requests succeed, no block leaks; the
  replacement waits (no free GPU) until the node rejoins, and then lands on it;
- infra/serve/cpu.yaml rolled onto the cluster unchanged by `kvserve deploy`;
- autoscaling: `kvserve deploy` with `autoscaling` (1 to 3), and a `kvserve loadtest` ramp
  drives the replica count up across nodes and back to 1 after the load;
- `kvserve down` stops every node, the rejoined one included.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import pytest

from kvserve.cluster import local_head
from kvserve.cluster.ray_compat import QUIET_SERVE_ENV
from kvserve.v1 import generation_pb2 as pb
from kvserve.v1 import generation_pb2_grpc as pb_grpc
from tests.helpers import poll
from tests.serving import METADATA, free_port
from tests.test_cli import KVSERVE
from tests.test_cli_detached import new_user_env
from tests.test_serve_cache import HIT_RATE, conversations

pytestmark = [pytest.mark.ray, pytest.mark.timeout(300)]

NODES = 3
STREAMS = 6
INFRA_SERVE = Path(__file__).resolve().parents[1] / "infra" / "serve"
LEASE_TTL_S = 10.0  # AppConfig.kv_lease_ttl_s's default: the index drops a silent replica's entries
LOGICAL_GPU = "no CUDA device is visible: a logical GPU only"


# What `kvserve status --json` and `kvserve cache check` compute, answered by one driver that
# stays connected: polled in loops, each CLI call would pay a process start and a Ray connect.
DRIVER = """
import json, sys
import ray
from ray import serve
from kvserve.cache_manager import actor as cache_manager
from kvserve.cluster import local_head, ray_compat
from kvserve.cluster.cache_check import find_problems
from kvserve.cli.status import collect_status
local_head.connect_driver(sys.argv[1], logging_level="ERROR")
key = cache_manager.deployment_key("kvserve", "Generation")
for line in sys.stdin:
    if line.strip() == "status":
        answer = collect_status()
    elif line.strip() == "where":  # the head's node id, and the cache manager's
        [head] = [n["NodeID"] for n in ray.nodes()
                  if n["Alive"] and ray_compat.HEAD_NODE_RESOURCE in n["Resources"]]
        answer = [head, ray.get(cache_manager.get(key).node_id.remote())]
    else:
        answer = find_problems(serve.get_deployment_handle("Generation", "kvserve"),
                               cache_manager.get(key))
    print("answer:", json.dumps(answer), flush=True)  # Ray may log to stdout too
"""


@dataclass
class SimCluster:
    """The module's cluster, driven as a user drives it: the kvserve CLI, a gRPC client, and
    for polling a driver of its own (never pytest's own process: it would keep this cluster's
    auth settings in its environment)."""

    env: dict[str, str]
    port: int
    state: local_head.UpState
    channel: grpc.Channel = field(init=False)
    driver: subprocess.Popen | None = None

    def __post_init__(self) -> None:
        self.channel = grpc.insecure_channel(f"127.0.0.1:{self.port}")
        self.stub = pb_grpc.GenerationStub(self.channel)
        self.metadata = METADATA

    def kvserve(self, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
        return subprocess.run([*KVSERVE, *args], capture_output=True, text=True, env=self.env,
                              timeout=timeout)

    def _ask(self, question: str) -> Any:
        if self.driver is None:
            self.driver = subprocess.Popen(
                [sys.executable, "-c", DRIVER, self.state.address], stdin=subprocess.PIPE,
                stdout=subprocess.PIPE, text=True, env=self.env | (self.state.env or {}))
        self.driver.stdin.write(question + "\n")
        self.driver.stdin.flush()
        while not (line := self.driver.stdout.readline()).startswith("answer: "):
            assert line, "the status driver died"
        return json.loads(line.removeprefix("answer: "))

    def status(self) -> dict:
        """What `kvserve status --json` prints."""
        return self._ask("status")

    def running(self) -> list[dict]:
        return [r for r in self.status()["replicas"] if r["state"] == "RUNNING"]

    def cache_problems(self) -> list[str]:
        """What `kvserve cache check` prints: every difference between Redis and the replicas."""
        return self._ask("check")

    def close(self) -> None:
        self.channel.close()
        if self.driver is not None:
            self.driver.stdin.close()
            self.driver.wait(30)
            self.driver = None

    def greedy(self, prompt: str, max_tokens: int = 6) -> list[int]:
        request = pb.GenerateRequest(prompt=prompt, params=pb.SamplingParams(
            temperature=0, max_tokens=max_tokens))
        return [t for r in self.stub.Generate(request, metadata=self.metadata, timeout=120)
                for t in r.token_ids]


@pytest.fixture(scope="module")
def sim(model_dir: Path, tmp_path_factory) -> Iterator[SimCluster]:
    # Serve on three nodes' worth of processes, polling less while idle (ray_compat)
    env = new_user_env(model_dir, tmp_path_factory.mktemp("multinode")) | QUIET_SERVE_ENV
    port = free_port()
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("KVSERVE_CACHE_DIR", env["KVSERVE_CACHE_DIR"])  # read_state() below
        try:
            up = subprocess.run(
                [*KVSERVE, "up", "--detach", "--local-nodes", str(NODES), "--gpus-per-node", "1",
                 "--cpus-per-node", "4",  # infra/serve/gpu.yaml's replica asks for 4
                 "--replicas", "3", "--num-gpus-per-replica", "1", "--kv-cache-memory",
                 "256MiB", "--grpc-port", str(port), "--http-port", str(free_port()),
                 "--no-dashboard"],  # not what this module tests: 5 CPU-s less
                capture_output=True, text=True, env=env, timeout=400)
            assert up.returncode == 0, up.stdout + up.stderr
            assert f"started {NODES} Ray nodes here" in up.stdout
            state = local_head.read_state()
            assert state is not None and len(state.node_pids) == NODES - 1
            cluster = SimCluster(env, port, state)
            yield cluster
            cluster.close()
        finally:
            leftover = local_head.read_state()
            if leftover is not None and leftover.started_head and leftover.head_pid:
                local_head.stop_head(leftover.head_pid, leftover.temp_dir,
                                     node_pids=leftover.node_pids)


def test_three_local_nodes_one_logical_gpu_each_one_replica_per_node(sim: SimCluster):
    state = sim.state
    assert all(local_head._is_ray_start(p, state.temp_dir) for p in state.node_pids)
    replicas = sim.status()["replicas"]
    assert [r["state"] for r in replicas] == ["RUNNING"] * 3
    nodes = {r["node_id"] for r in replicas}
    assert len(nodes) == 3 and "" not in nodes  # one replica per node
    assert [r["gpu_ids"] for r in replicas] == [["0"]] * 3  # each node's one GPU
    assert [r["device"] for r in replicas] == ["cpu"] * 3
    table = sim.kvserve("status").stdout
    assert "NODE" in table and "GPU" in table
    assert all(r["node_id"][:8] in table for r in replicas)

    logs = list(Path(state.temp_dir).glob("session_latest/logs/serve/replica_*.log"))
    said = [log.read_text().count(LOGICAL_GPU) for log in logs]
    assert sorted(said) == [0] * (len(said) - 3) + [1, 1, 1]  # once per replica

    gen = sim.kvserve("generate", "--target", f"127.0.0.1:{sim.port}", "Hello", "--max-tokens",
                      "3", "--json")
    assert gen.returncode == 0, gen.stderr
    assert len(json.loads(gen.stdout)["token_ids"]) == 3
    # the cache manager sits on the head node, and its index matches replicas on all three
    # (through the open driver: the CLI's own multi-node check runs after the node kill below)
    assert sim.cache_problems() == []
    head, manager_node = sim._ask("where")
    assert manager_node == head and head in nodes


# A driver that, unlike kvserve's own, asks for its workers' output (log_to_driver, Ray's
# default) and prints each line as it came, undeduplicated: one task on every node prints a mark.
PRINTING_DRIVER = """
import sys
import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy as On
ray.init(address=sys.argv[1])
@ray.remote(num_cpus=0)
def mark(i):
    print(f"mark-{i}-of-node", flush=True)
nodes = [n["NodeID"] for n in ray.nodes() if n["Alive"]]
ray.get([mark.options(scheduling_strategy=On(n, soft=False)).remote(i)
         for i, n in enumerate(nodes)])
print("nodes:", len(nodes), flush=True)
import time; time.sleep(3)  # the log monitor publishes what it reads every ~0.1 s
"""


def test_a_driver_gets_each_line_its_workers_print_once_from_every_node(sim: SimCluster):
    """The nodes share the head's session directory on this machine, so only the head runs a
    log monitor (kvserve/cluster/local_head.start_worker_nodes). Negative control, by hand: with
    a monitor on every node, each line reaches the driver three times."""
    out = subprocess.run([sys.executable, "-c", PRINTING_DRIVER, sim.state.address],
                         capture_output=True, text=True, timeout=120,
                         env=sim.env | (sim.state.env or {}) | {"RAY_DEDUP_LOGS": "0"})
    assert out.returncode == 0, out.stderr[-3000:]
    said = out.stdout + out.stderr  # Ray prints workers' lines to the driver's stderr
    assert f"nodes: {NODES}" in said, said[-3000:]
    assert [said.count(f"mark-{i}-of-node") for i in range(NODES)] == [1] * NODES, said[-3000:]


def test_multi_turn_chats_stay_on_their_historys_replica_across_nodes(sim: SimCluster):
    """The single-node routing test's bar (tests/test_serve_cache.py), with the replicas on
    three nodes and the router in the head's proxy reaching the manager across raylets: every
    later turn finds its history cached, and turns 2-3 hit > 90% of their prompt tokens. Three
    turns, not that test's five: each of the 16 later turns is routed across nodes as a fifth
    turn would be. (Its negative control, routing off, is that test's, also at three turns.)"""
    chats = conversations(sim, turns=3)
    later = [(i, turn, usage) for i, usages in enumerate(chats)
             for turn, usage in enumerate(usages[1:], start=2)]
    missed = [(i, turn) for i, turn, u in later if not u.cached_tokens > 0.8 * u.prompt_tokens]
    rate = sum(u.cached_tokens for *_, u in later) / sum(u.prompt_tokens for *_, u in later)
    assert missed == [], missed
    assert rate > HIT_RATE, rate
    # (where the first turns went is the router's load-based choice: usually all three nodes)
    print("cached blocks per node:", {r["node_id"][:8]: r["kv_cached_blocks"]
                                      for r in sim.running()})
    assert sim.cache_problems() == []  # the index on the head matches every node's replica


class _Streams:
    """Long greedy streams, each in a thread, each recording how it ended."""

    def __init__(self, sim: SimCluster, count: int) -> None:
        self.calls, self.tokens = [], [0] * count
        self.ended: list[tuple[str, float] | None] = [None] * count
        self.details: list[str | None] = [None] * count
        self.threads = []
        for i in range(count):
            request = pb.GenerateRequest(
                prompt=f"Story {i}: tell me a very long story about the sea.",
                params=pb.SamplingParams(max_tokens=2000, ignore_eos=True, temperature=0))
            call = sim.stub.Generate(request, metadata=sim.metadata, timeout=240)
            self.calls.append(call)
            self.threads.append(threading.Thread(target=self._read, args=(i,), daemon=True))
            self.threads[-1].start()

    def _read(self, i: int) -> None:
        try:
            for msg in self.calls[i]:
                self.tokens[i] += len(msg.token_ids)
            self.ended[i] = ("OK", time.monotonic())
        except grpc.RpcError as exc:
            self.details[i] = exc.details()
            self.ended[i] = (exc.code().name, time.monotonic())

    def cancel(self) -> None:
        for call in self.calls:
            call.cancel()
        for t in self.threads:
            t.join(30)


def _node_of(pid: int, node_pids: list[int]) -> int | None:
    """The worker node (its `ray start --block` pid) whose session holds process `pid`."""
    with contextlib.suppress(ProcessLookupError):
        sid = os.getsid(pid)
        return sid if sid in node_pids else None
    return None


def _kill_node(node_pid: int) -> None:
    """The node disappears: SIGKILL its raylet first, then every other process of its session
    (the GCS, dashboard and Serve controller live on the head, untouched)."""
    pids = local_head._session_pids(node_pid)
    raylets = [p for p in pids if "raylet" in Path(f"/proc/{p}/comm").read_text()]
    assert raylets, "no raylet in the node's session"
    for pid in raylets + [p for p in pids if p not in raylets]:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def test_a_worker_node_killed_mid_stream(sim: SimCluster):
    """Streams on the dead node's replica end UNAVAILABLE; the others go on; its index entries
    vanish within the lease; new requests succeed; no block leaks. The replacement cannot be
    placed while the node is down (each surviving node's one GPU is taken: Ray's GPU accounting
    holds), and lands on the node once it rejoins."""
    state = sim.state
    expected = sim.greedy("The capital of France is")
    streams = _Streams(sim, STREAMS)
    try:
        rows = []
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # every stream admitted, one on a worker node
            rows = sim.running()
            on_workers = [r for r in rows if r["running"] and _node_of(r["pid"], state.node_pids)]
            if sum(r["running"] or 0 for r in rows) == STREAMS and on_workers \
                    and min(streams.tokens):
                break
            time.sleep(0.3)
        else:
            raise AssertionError(f"the streams were not all admitted: {rows}")
        victim = on_workers[0]
        node_pid = _node_of(victim["pid"], state.node_pids)
        _kill_node(node_pid)
        killed_at = time.monotonic()

        # the victim's streams end UNAVAILABLE (within 30 s as a rule; Ray's detection of
        # the node's death, the latest, bounds it); the other streams go on
        for _ in range(900):
            if sum(e is not None for e in streams.ended) >= victim["running"]:
                break
            time.sleep(0.1)
        ended = [e for e in streams.ended if e is not None]
        print(f"the victim ran {victim['running']} streams; they ended after",
              [round(t - killed_at, 1) for _, t in ended], "s")
        assert len(ended) == victim["running"], (streams.ended, victim)
        assert {code for code, _ in ended} == {"UNAVAILABLE"}, (ended, streams.details)
        assert min(t for _, t in ended) - killed_at < 30
        going = list(streams.tokens)
        time.sleep(1.0)
        assert sum(e is None for e in streams.ended) == STREAMS - victim["running"]
        assert all(streams.tokens[i] > going[i] for i in range(STREAMS)
                   if streams.ended[i] is None)
    finally:
        streams.cancel()

    # new requests succeed on the surviving replicas
    assert [sim.greedy("The capital of France is") for _ in range(3)] == [expected] * 3
    # within the lease the dead replica's index entries are gone: Redis matches the survivors
    problems = poll(sim.cache_problems, lambda p: p == [], LEASE_TTL_S + 20, interval_s=1)
    assert problems == [] and time.monotonic() - killed_at < LEASE_TTL_S + 30, problems
    # no block leaked on the survivors; the replacement waits for a GPU
    survivors = sim.running()
    assert len(survivors) == 2 and victim["replica_id"] not in {r["replica_id"]
                                                                for r in survivors}
    assert all(r["running"] == 0 and r["kv_cache_usage"] == 0 for r in survivors), survivors
    report = sim.status()
    waiting = [r for r in report["replicas"] if r["state"] != "RUNNING"
               and r["replica_id"] != victim["replica_id"]]  # (the victim may show STOPPING)
    assert len(waiting) == 1 and len(report["replicas"]) - len(waiting) - len(survivors) <= 1, \
        report

    # the node rejoins (the same command, new raylet); the replacement lands on it
    cpus = local_head.LocalNodes(NODES, 1).cpus_per_node(3.0)
    [pid] = local_head.start_worker_nodes(state, 1, cpus, num_gpus=1)
    state.node_pids = [p for p in state.node_pids if p != node_pid] + [pid]
    local_head.write_state(state)  # `kvserve down` stops it too
    rows = poll(sim.running, lambda rows: len(rows) == 3, 120, interval_s=1)
    assert len(rows) == 3 and len({r["node_id"] for r in rows}) == 3, rows
    assert _node_of(next(r["pid"] for r in rows if r["node_id"] not in
                         {s["node_id"] for s in survivors}), [pid]) == pid
    assert sim.greedy("The capital of France is") == expected
    check = sim.kvserve("cache", "check")  # as a user checks it
    assert check.returncode == 0 and "matches every replica" in check.stdout, check.stderr


AUTOSCALING = """\
autoscaling:
  min_replicas: 1
  max_replicas: 3
  target_ongoing_requests: 1
  upscale_delay_s: 1
  downscale_delay_s: 2
  look_back_period_s: 2
  metrics_interval_s: 0.5
num_gpus_per_replica: 1
kv_cache_memory: 64MiB
max_num_seqs: 2
max_waiting_requests: 2
# Serve sends a replica no more than it admits (2 running + 2 waiting), tries another when it
# is full, and holds one request itself: the recipe in docs/deploying.md, "Autoscaling"
max_ongoing_requests: 4
max_queued_requests: 1
"""


def _rolled_over(sim: SimCluster, before: set[str], timeout_s: float = 120) -> list[dict]:
    """The RUNNING replicas once each is new (the old ones stopping or gone: Serve routes
    only to RUNNING replicas)."""
    return poll(sim.running, lambda rows: bool(rows) and not {r["replica_id"] for r in rows}
                & before and all(r["gpu_ids"] is not None for r in rows),  # its row published
                timeout_s, interval_s=0.5)


def _settled_on_one_replica(sim: SimCluster, timeout_s: float = 120) -> dict:
    """The status once Serve lists exactly one replica, RUNNING (the rollover is over)."""
    return poll(sim.status, lambda r: [x["state"] for x in r["replicas"]] == ["RUNNING"],
                timeout_s, interval_s=0.5)


def test_the_serve_yamls_deploy_onto_the_cluster_unchanged_but_for_the_model(
        sim: SimCluster, model_dir: Path):
    """infra/serve/cpu.yaml's application as it is (its model null: the default), then
    gpu.yaml's with only the model replaced (Llama-3-8B is not here), rolled onto the running
    cluster by `kvserve deploy`; their ports and proxy options are the running Serve instance's.
    gpu.yaml's replica takes a logical GPU and 4 CPUs, and runs its CUDA settings on the CPU,
    saying what it gave up (kvserve/cluster/deployment.py on_logical_gpus)."""
    before = {r["replica_id"] for r in sim.status()["replicas"]}
    deploy = sim.kvserve("deploy", "--config", str(INFRA_SERVE / "cpu.yaml"))
    assert deploy.returncode == 0, deploy.stdout + deploy.stderr
    assert "with 1 replica(s)" in deploy.stdout
    rows = _rolled_over(sim, before)
    assert [r["gpu_ids"] for r in rows] == [[]], rows  # cpu.yaml: one replica, no GPU
    assert len(sim.greedy("The capital of France is")) == 6

    deploy = sim.kvserve("deploy", "--config", str(INFRA_SERVE / "gpu.yaml"),
                         "--model", str(model_dir))
    assert deploy.returncode == 0, deploy.stdout + deploy.stderr
    assert "1-8 replicas (autoscaling)" in deploy.stdout
    [replica] = _rolled_over(sim, before | {rows[0]["replica_id"]})
    assert replica["gpu_ids"] == ["0"], replica  # min_replicas 1, one GPU each
    assert len(sim.greedy("The capital of France is")) == 6
    logs = Path(sim.state.temp_dir).glob("session_latest/logs/serve/replica_*.log")
    said = "".join(log.read_text() for log in logs)  # (only this replica had a GPU config)
    # (its attention_backend auto needs no change: the CPU kernels there)
    for change in ("device cuda -> cpu", "cpu_offload_memory 16GiB -> 536870912"):
        assert change in said, said[-3000:]


def test_autoscaling_follows_a_load_ramp_across_nodes_and_back(sim: SimCluster,
                                                               tmp_path: Path):
    """`kvserve deploy` with autoscaling 1-3; a `kvserve loadtest` ramp drives the replica count
    up (onto other nodes: one GPU each) and it returns to 1 after the load; the summary records
    and plots the count over time. Refusals fall as replicas come up: the refused share of stream
    ends under each count (`refusals_by_replicas`) is at most 0.2 while two or more serve, and
    under half its one-replica share.

    A replica admits 4 requests and Serve queues one more (`max_ongoing_requests` 4,
    `max_queued_requests` 1): one replica takes 5 users, two take 10. The load rises one user a
    second to 8 and holds for the rest of 48 s, so one replica is overloaded from 5 s in; a new
    replica takes 12-31 s to come up, so a slower rise lets it come up before the first is
    overloaded, and a shorter hold leaves too few streams at two replicas. Negative control, by
    hand: without the two Serve limits (`max_ongoing_requests` 256), Serve sends to a full replica
    while another has room, and the share goes only from 0.53 at one replica to 0.28 at two or
    three, failing both bars."""
    config = tmp_path / "autoscaling.yaml"
    config.write_text(AUTOSCALING)
    deploy = sim.kvserve("deploy", "--config", str(config))
    assert deploy.returncode == 0, deploy.stdout + deploy.stderr
    assert "1-3 replicas (autoscaling)" in deploy.stdout
    report = _settled_on_one_replica(sim)
    assert report["replicas"][0]["gpu_ids"] == ["0"], report

    out, users = tmp_path / "load", 8
    load = sim.kvserve("loadtest", "--target", f"127.0.0.1:{sim.port}", "--users", str(users),
                       "--shape", "ramp-hold", "--spawn-rate", "1", "--run-time", "48s",
                       "--workload", "short", "--out", str(out), "--json", timeout=200)
    assert load.returncode == 0, load.stdout[-2000:] + load.stderr[-3000:]
    summary = json.loads(load.stdout)
    print("replicas over time:", summary["replicas_over_time"])
    print("users, failures over time:", summary["load_over_time"])
    print("refusals by replicas:", summary["refusals_by_replicas"])
    counts = [n for _, n in summary["replicas_over_time"]]
    assert counts and counts[0] == 1 and max(counts) >= 2, summary["replicas_over_time"]
    assert summary["load_over_time"] and (out / "load.png").stat().st_size > 10_000
    rows = summary["refusals_by_replicas"]  # every stream's end, under the count serving then
    assert [r["replicas"] for r in rows] == sorted(set(counts)), rows
    # Locust's count (failures included) misses a stream that ends while it stops (after its
    # last stats): at most one per user. The refused ones match exactly.
    ended = sum(r["streams"] for r in rows)
    assert summary["streams"] <= ended <= summary["streams"] + users, (rows, summary["streams"])
    assert sum(r["refused"] for r in rows) == summary["failures"].get("RESOURCE_EXHAUSTED", 0)
    assert summary["streams"] > 0
    one, more = rows[0], rows[1:]  # one replica; two or more (a third may come up at the end)
    assert one["refused"] > 0, rows  # one replica could not take the rise
    streams, refused = sum(r["streams"] for r in more), sum(r["refused"] for r in more)
    # with Serve routing around full replicas, few are refused once two serve; without it (the
    # control in the docstring), half were
    assert streams >= 10 and refused / streams <= 0.2, rows
    assert refused / streams < one["refused_share"] / 2, rows

    report = poll(sim.status, lambda r: len(r["replicas"]) == 1, 90, interval_s=1)
    assert [r["state"] for r in report["replicas"]] == ["RUNNING"], report


def test_down_stops_every_node_the_rejoined_one_included(sim: SimCluster):
    sim.close()  # its driver too
    state = local_head.read_state()
    assert state is not None and len(state.node_pids) == NODES - 1
    down = sim.kvserve("down")
    assert down.returncode == 0, down.stderr
    pids = [state.head_pid, *state.node_pids]
    deadline = time.monotonic() + 10
    while any(local_head._session_pids(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(local_head._session_pids(p) for p in pids), "Ray processes left behind"
    assert local_head.read_state() is None
