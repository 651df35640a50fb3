"""Many nodes, simulated (#21, part 1): `kvserve up --local-nodes 3 --gpus-per-node 1` starts a
head and two worker nodes on this machine as separate raylets, each declaring one logical GPU;
three replicas with one GPU each land on three distinct nodes, say once that their GPU is only
logical, serve on the CPU, show their node and GPU in `kvserve status`; `kvserve down` stops
every node it started."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cluster import local_head
from tests.serving import free_port
from tests.test_cli import KVSERVE
from tests.test_cli_detached import new_user_env

pytestmark = [pytest.mark.ray, pytest.mark.timeout(600)]

LOGICAL_GPU = "no CUDA device is visible: a logical GPU only"
WHERE_IS_THE_MANAGER = """
import sys, ray
from cache_manager import actor as cache_manager
from cluster import local_head, ray_compat
local_head.connect_driver(sys.argv[1], logging_level="ERROR")
[head] = [n["NodeID"] for n in ray.nodes()
          if n["Alive"] and ray_compat.HEAD_NODE_RESOURCE in n["Resources"]]
manager = cache_manager.get(cache_manager.deployment_key("kvserve", "Generation"))
print(head, ray.get(manager.node_id.remote()))
"""


def test_three_local_nodes_one_logical_gpu_each_one_replica_per_node(model_dir, tmp_path,
                                                                     monkeypatch):
    env = new_user_env(model_dir, tmp_path)
    monkeypatch.setenv("KVSERVE_CACHE_DIR", env["KVSERVE_CACHE_DIR"])  # read_state() below

    def kvserve(*args: str, timeout: float = 400) -> subprocess.CompletedProcess:
        return subprocess.run([*KVSERVE, *args], capture_output=True, text=True, env=env,
                              timeout=timeout)

    port = free_port()
    try:
        up = kvserve("up", "--detach", "--local-nodes", "3", "--gpus-per-node", "1",
                     "--replicas", "3", "--num-gpus-per-replica", "1", "--kv-cache-memory",
                     "64MiB", "--grpc-port", str(port), "--http-port", str(free_port()))
        assert up.returncode == 0, up.stdout + up.stderr
        assert "started 3 Ray nodes here" in up.stdout
        state = local_head.read_state()
        assert state is not None and len(state.node_pids) == 2
        assert all(local_head._is_ray_start(p, state.temp_dir) for p in state.node_pids)

        report = json.loads(kvserve("status", "--json").stdout)
        replicas = report["replicas"]
        assert [r["state"] for r in replicas] == ["RUNNING"] * 3
        nodes = {r["node_id"] for r in replicas}
        assert len(nodes) == 3 and "" not in nodes  # one replica per node
        assert [r["gpu_ids"] for r in replicas] == [["0"]] * 3  # each node's one GPU
        assert [r["device"] for r in replicas] == ["cpu"] * 3
        table = kvserve("status").stdout
        assert "NODE" in table and "GPU" in table
        assert all(r["node_id"][:8] in table for r in replicas)

        logs = list(Path(state.temp_dir).glob("session_latest/logs/serve/replica_*.log"))
        said = [log.read_text().count(LOGICAL_GPU) for log in logs]
        assert sorted(said) == [0] * (len(said) - 3) + [1, 1, 1]  # once per replica

        gen = kvserve("generate", "--target", f"127.0.0.1:{port}", "Hello", "--max-tokens",
                      "3", "--json")
        assert gen.returncode == 0, gen.stderr
        assert len(json.loads(gen.stdout)["token_ids"]) == 3
        # the cache manager sits on the head node, and its index matches replicas on all three
        check = kvserve("cache", "check")
        assert check.returncode == 0 and "matches every replica" in check.stdout, check.stderr
        # asked by a driver of its own: connecting this process would leave the cluster's auth
        # settings in its environment, and the shared test cluster started later would fail
        where = subprocess.run([sys.executable, "-c", WHERE_IS_THE_MANAGER, state.address],
                               capture_output=True, text=True, timeout=120,
                               env=env | (state.env or {}))
        assert where.returncode == 0, where.stderr[-3000:]
        head, manager_node = where.stdout.split()
        assert manager_node == head and head in nodes

        down = kvserve("down")
        assert down.returncode == 0, down.stderr
        deadline = time.monotonic() + 10
        pids = [state.head_pid, *state.node_pids]
        while any(local_head._session_pids(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not any(local_head._session_pids(p) for p in pids), "Ray processes left behind"
        assert local_head.read_state() is None
    finally:
        leftover = local_head.read_state()
        if leftover is not None and leftover.started_head and leftover.head_pid:
            local_head.stop_head(leftover.head_pid, leftover.temp_dir,
                                 node_pids=leftover.node_pids)
