"""Replica health over real Ray Serve: every replica runs a warm-up request before it takes
traffic and leaves nothing of it behind; a replica whose engine step loop died fails Serve's
health check and is replaced, after which requests succeed again."""

from __future__ import annotations

import asyncio
import time
import types

import grpc
import pytest

from kvserve.cluster.deployment import ADMIN_ENV, GenerationDeployment, _warm_up
from kvserve.v1 import generation_pb2 as pb
from kvserve.workers.async_engine import AsyncLLMEngine
from tests.helpers import poll
from tests.serving import serve_locally
from tests.test_serve_replica_kill import _replica_rows, _replica_states

pytestmark = pytest.mark.ray  # starts Ray, so also slow (tests/suite_plugin.py)
USES_SHARED_RAY = "4"  # tests/serving.py: run with the modules of this group

# Serve's defaults (10 s period, 3 failures in a row) would take 30 s to notice a dead loop
HEALTH_CHECKS = {"health_check_period_s": 1, "health_check_timeout_s": 5}
FAIL_FAST_S = 30  # the request that meets the dead loop fails this soon (no hang)
REPLACED_WITHIN_S = 300  # a loaded 2-core CI machine starts a replica slowly


def _assert_warmed_up_and_clean(handle) -> None:
    """The replica ran its 2-token warm-up, and it left no KV block, cache entry or prefix
    query behind, in the engine or in what the replica reports to the cache manager."""
    report = handle.warm_up_report.remote().result()
    assert report["generated_tokens"] == 2 and report["prompt_tokens"] > 0, report
    stats = handle.kv_stats.remote().result()
    assert (stats["device_used"], stats["device_cached"], stats["host_used"]) == (0, 0, 0), stats
    assert (stats["prefix_queried_tokens"], stats["prefix_hit_tokens"]) == (0, 0), stats
    state = handle.kv_state.remote().result()
    assert (state.device, state.host, state.requests) == ([], [], {}), state


def _rows_or_none(handle) -> list[dict]:
    """The replicas' status rows; none while Serve has no replica to send to."""
    from ray.serve.exceptions import DeploymentUnavailableError

    try:
        return _replica_rows(handle, timeout=5)
    except DeploymentUnavailableError:
        return []


def _greedy(served) -> list[int]:
    responses = served.stream("The capital of France is", temperature=0, max_tokens=4)
    assert responses[-1].finish_reason == pb.FINISH_REASON_LENGTH
    return [t for r in responses for t in r.token_ids]


def test_a_replica_whose_step_loop_died_is_replaced_and_every_replica_warms_up(monkeypatch):
    monkeypatch.setenv(ADMIN_ENV, "1")  # the local Ray cluster's workers inherit it
    app = {"replicas": 1, "kv_cache_memory": "64MiB", **HEALTH_CHECKS}
    with serve_locally(app, env={ADMIN_ENV: "1"}) as served:  # (the session cluster's env)
        _assert_warmed_up_and_clean(served.handle)  # before the first user request
        expected = _greedy(served)
        victim = served.handle.admin.remote("fail_next_step").result()

        started = time.monotonic()
        with pytest.raises(grpc.RpcError) as err:
            served.stream("Hello", max_tokens=4)
        failed_after = time.monotonic() - started
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE, err.value
        assert "step loop died" in err.value.details()
        assert "injected step failure" in err.value.details()
        assert failed_after < FAIL_FAST_S

        def replaced(rows: list[dict]) -> bool:
            return (len(rows) == 1 and rows[0]["replica_id"] != victim
                    and _replica_states(served.app) == {"RUNNING": 1})

        started = time.monotonic()
        rows = poll(lambda: _rows_or_none(served.handle), replaced,
                    REPLACED_WITHIN_S, interval_s=0.5)
        assert replaced(rows), (victim, rows, _replica_states(served.app))
        print(f"request failed after {failed_after:.2f} s; replica replaced after "
              f"{time.monotonic() - started:.1f} s")
        _assert_warmed_up_and_clean(served.handle)  # the replacement warmed up too
        assert _greedy(served) == expected


def test_admin_is_refused_unless_the_replicas_environment_allows_it(monkeypatch):
    monkeypatch.delenv(ADMIN_ENV, raising=False)
    replica = types.SimpleNamespace(engine=None, status_publisher=None)
    with pytest.raises(PermissionError, match=ADMIN_ENV):
        GenerationDeployment.func_or_class.admin(replica, "fail_next_step")


def test_a_failed_warm_up_fails_the_replica_start_with_a_clear_error(make_tiny_engine):
    core = make_tiny_engine()

    def failing_step() -> list:
        raise RuntimeError("CUDA error: no kernel image is available")

    core.step = failing_step

    async def start() -> None:
        await _warm_up(AsyncLLMEngine(core))

    with pytest.raises(RuntimeError, match="warm-up request failed, so it does not start.*"
                                           "no kernel image"):
        asyncio.run(start())
