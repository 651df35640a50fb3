"""Killing one replica's process mid-stream ends that client's stream with an error status
(not a hang); Serve replaces the replica and new requests succeed."""

from __future__ import annotations

import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from kvserve.v1 import generation_pb2 as pb
from tests.serving import TWO_REPLICAS, serve_locally

USES_SHARED_RAY = "3c"  # tests/serving.py: run with the modules of this group

pytestmark = pytest.mark.ray  # starts Ray, so also slow (tests/suite_plugin.py)

STREAM_DEADLINE_S = 300  # a hang would show as DEADLINE_EXCEEDED here, never block the suite
ERROR_WITHIN_S = 30  # the killed stream must end this soon after the kill


def _replica_rows(handle, timeout: float = 30) -> list[dict]:
    """Every replica's status row (`GenerationDeployment.status`), via a broadcast."""
    results = handle.broadcast("status").results(timeout_s=timeout, return_exceptions=True)
    return [r for r in results if isinstance(r, dict)]


def _replica_states(app: str) -> dict[str, int]:
    from ray import serve

    application = serve.status().applications.get(app)
    if application is None:
        return {}
    return dict(application.deployments["Generation"].replica_states)


def _greedy(served, prompt: str) -> tuple[list[int], int]:
    responses = served.stream(prompt, temperature=0, max_tokens=8)
    return [t for r in responses for t in r.token_ids], responses[-1].finish_reason


def test_killing_a_replica_mid_stream_errors_that_stream_and_serve_recovers():
    # reuse: the test ends only once Serve has replaced the killed replica and both serve
    with serve_locally(TWO_REPLICAS, reuse=True) as served:
        prompt = "The capital of France is"
        expected, reason = _greedy(served, prompt)
        assert reason == pb.FINISH_REASON_LENGTH and len(expected) == 8

        before = _replica_rows(served.handle)
        assert len({r["replica_id"] for r in before}) == 2, before

        request = pb.GenerateRequest(
            prompt="Tell me a very long story.",
            params=pb.SamplingParams(max_tokens=2000, ignore_eos=True, temperature=0),
        )
        stream = served.stub.Generate(request, metadata=served.metadata, timeout=STREAM_DEADLINE_S)
        received = 0
        for msg in stream:
            received += len(msg.token_ids)
            if received >= 5:
                break
        busy = [r for r in _replica_rows(served.handle) if r["running"] > 0]
        assert len(busy) == 1, busy
        victim = busy[0]

        os.kill(victim["pid"], signal.SIGKILL)
        killed_at = time.monotonic()
        try:
            for msg in stream:
                received += len(msg.token_ids)
                assert not msg.finish_reason, "the stream finished normally after the kill"
            raise AssertionError("the stream ended with OK status after its replica was killed")
        except grpc.RpcError as exc:
            error = exc
        waited = time.monotonic() - killed_at
        print(f"killed stream: {error.code().name} after {waited:.2f} s: {error.details()}")
        assert error.code() == grpc.StatusCode.UNAVAILABLE, error  # retryable: replica died
        assert waited < ERROR_WITHIN_S, f"the stream took {waited:.1f} s to fail"
        assert received < 2000

        # Serve notices the death, starts a replacement; new requests succeed.
        deadline, states, rows = time.monotonic() + 120, {}, []
        while time.monotonic() < deadline:
            states = _replica_states(served.app)
            if states == {"RUNNING": 2}:
                rows = _replica_rows(served.handle)
                ids = {r["replica_id"] for r in rows}
                if len(ids) == 2 and victim["replica_id"] not in ids:
                    break
            time.sleep(1)
        else:
            raise AssertionError(f"Serve did not recover 2 RUNNING replicas: {states}, {rows}")
        pids = {r["pid"] for r in rows}
        assert victim["pid"] not in pids and len(pids) == 2, (victim, rows)

        with ThreadPoolExecutor(4) as pool:
            results = list(pool.map(lambda _: _greedy(served, prompt), range(4)))
        assert results == [(expected, pb.FINISH_REASON_LENGTH)] * 4
