"""A Serve replica with tensor_parallel_size 2 over real Ray: its placement group has a bundle
per rank, rank 1 is a Ray actor in the second, it streams over gRPC and HTTP what the
in-process tp 1 engine computes, and a killed or failing rank ends the stream UNAVAILABLE
within seconds, after which Serve replaces the replica (a new placement group) and the next
request succeeds. After the app is deleted no rank, placement group or shared memory is left.

The model is a tiny random Llama saved as a directory (8 heads, 4 KV heads: SmolLM2's 9 heads
do not split in two), served as `--model DIR` is."""

from __future__ import annotations

import json
import os
import signal
import time
import urllib.request

import grpc
import pytest

from kvserve.cluster.cache_check import find_problems
from kvserve.process import pid_alive
from kvserve.v1 import generation_pb2 as pb
from kvserve.workers.config import EngineConfig
from kvserve.workers.engine import LLMEngine
from kvserve.workers.model_executor.tiny import save_checkpoint
from tests.helpers import noisy_checkpoint, output_ids, poll
from tests.serving import serve_locally
from tests.test_serve_replica_health import HEALTH_CHECKS
from tests.test_serve_replica_kill import _replica_rows, _replica_states

pytestmark = pytest.mark.ray  # starts Ray, so also slow (tests/suite_plugin.py)
USES_SHARED_RAY = "4"  # tests/serving.py: run with the modules of this group

FAIL_WITHIN_S = 10
REPLACED_WITHIN_S = 300  # a loaded 2-core CI machine starts a replica slowly
PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-llama-tp")
    save_checkpoint(noisy_checkpoint("llama", num_attention_heads=8, num_key_value_heads=4,
                                     head_dim=16, max_position_embeddings=8192), path)
    return path


@pytest.fixture(scope="module")
def expected(model_dir) -> list[int]:
    """Greedy tokens of the in-process engine at tp 1 on the same directory."""
    engine = LLMEngine(EngineConfig(model=str(model_dir), device="cpu",
                                    kv_cache_memory=16 * 1024**2))
    outs = engine.generate_all([{"prompt": PROMPT, "params": {
        "temperature": 0, "max_tokens": 12, "ignore_eos": True}}])
    return output_ids(next(iter(outs.values())))


def _app(model_dir) -> dict:
    return {"model": str(model_dir), "replicas": 1, "tensor_parallel_size": 2,
            "num_cpus_per_replica": 1, "kv_cache_memory": "16MiB", **HEALTH_CHECKS}


def _placement_groups(state: str = "CREATED") -> list[dict]:
    import ray
    from ray.util import placement_group_table

    if not ray.is_initialized():  # (the session's cluster starts on first use)
        return []
    return [g for g in placement_group_table().values() if g["state"] == state]


def _greedy(served) -> list[int]:
    responses = served.stream(PROMPT, temperature=0, max_tokens=12, ignore_eos=True)
    return [t for r in responses for t in r.token_ids]


def _rows_or_none(handle) -> list[dict]:
    from ray.serve.exceptions import DeploymentUnavailableError

    try:
        return _replica_rows(handle, timeout=5)
    except DeploymentUnavailableError:
        return []


def _fail_mid_stream(served, fault) -> tuple[grpc.RpcError, float, str]:
    """Start a long stream, `fault(row)` once it has tokens; the stream's error and how long
    after the fault it came, and the replica it hit."""
    request = pb.GenerateRequest(prompt="Tell me a long story.", params=pb.SamplingParams(
        max_tokens=5000, ignore_eos=True, temperature=0))
    stream = served.stub.Generate(request, metadata=served.metadata, timeout=120)
    received = 0
    for msg in stream:
        received += len(msg.token_ids)
        if received >= 3:
            break
    row = _replica_rows(served.handle)[0]
    fault(row)
    at = time.monotonic()
    with pytest.raises(grpc.RpcError) as err:
        for msg in stream:
            assert not msg.finish_reason, "the stream finished normally after the fault"
    return err.value, time.monotonic() - at, row["replica_id"]


def _assert_replaced(served, victim: str, expected: list[int]) -> dict:
    """The replacement's status row, once it serves what the first replica did."""

    def replaced(rows: list[dict]) -> bool:
        return (len(rows) == 1 and rows[0]["replica_id"] != victim
                and _replica_states(served.app) == {"RUNNING": 1})

    rows = poll(lambda: _rows_or_none(served.handle), replaced, REPLACED_WITHIN_S, 0.5)
    assert replaced(rows), (victim, rows)
    assert len(rows[0]["rank_pids"]) == 1  # the new replica's own rank 1
    assert _greedy(served) == expected
    assert find_problems(served.handle, _manager(served), attempts=30) == []
    return rows[0]


def _manager(served):
    from kvserve.cache_manager import actor as cache_manager

    return cache_manager.get(served.manager_key)


def test_a_tp2_replica_streams_over_grpc_and_http_and_recovers_from_a_dead_rank(
        model_dir, expected):
    groups_before = len(_placement_groups())
    with serve_locally(_app(model_dir)) as served:
        # the replica's placement group: one bundle per rank, packed on one node
        groups = _placement_groups()
        assert len(groups) == groups_before + 1
        group = groups[-1]
        assert group["strategy"] == "STRICT_PACK" and len(group["bundles"]) == 2, group
        row = _replica_rows(served.handle)[0]
        assert len(row["rank_pids"]) == 1 and row["rank_pids"][0] != row["pid"], row
        rows = [row]  # every replica's, to check what each left behind

        assert _greedy(served) == expected  # gRPC, equal to the in-process tp 1 engine
        body = json.dumps({"model": str(model_dir), "prompt": PROMPT, "max_tokens": 12,
                           "temperature": 0, "ignore_eos": True}).encode()
        http = urllib.request.Request(served.http_url + "/v1/completions", body,
                                      {"Content-Type": "application/json"})
        answer = json.loads(urllib.request.urlopen(http, timeout=60).read())
        assert answer["usage"]["completion_tokens"] == 12, answer

        # rank 1's actor killed mid-stream
        error, waited, victim = _fail_mid_stream(
            served, lambda r: os.kill(r["rank_pids"][0], signal.SIGKILL))
        assert error.code() == grpc.StatusCode.UNAVAILABLE, error
        assert "tensor-parallel rank" in error.details()
        assert waited < FAIL_WITHIN_S, waited
        rows.append(_assert_replaced(served, victim, expected))

        # an exception inside rank 1's forward
        error, waited, victim = _fail_mid_stream(
            served, lambda r: served.handle.admin.remote("fail_rank_step").result())
        assert error.code() == grpc.StatusCode.UNAVAILABLE, error
        assert waited < FAIL_WITHIN_S, waited
        rows.append(_assert_replaced(served, victim, expected))
    # the app deleted: no rank actor, no placement group, no replica's segment in /dev/shm
    poll(lambda: len(_placement_groups()), lambda n: n == groups_before, 60)
    assert len(_placement_groups()) == groups_before
    left = [name for name in os.listdir("/dev/shm") for r in rows
            if name.startswith((f"kvserve-tp-{r['pid']}-", f"kvserve-tp-all-reduce-{r['pid']}-"))]
    assert not left, left
    alive = [p for r in rows for p in [r["pid"], *r["rank_pids"]] if pid_alive(p)]
    assert not alive, (alive, rows)

