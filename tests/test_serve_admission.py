"""The serving status codes through Ray Serve's proxy: RESOURCE_EXHAUSTED when a replica's
admission queue is full, UNAVAILABLE for the streams a shutting-down replica still holds
(Serve stops it after `graceful_shutdown_timeout_s`; kvserve.cluster.grpc_ingress maps the
death)."""

from __future__ import annotations

import threading

import grpc
import pytest

from kvserve.v1 import generation_pb2 as pb
from tests.helpers import poll
from tests.serving import serve_locally

USES_SHARED_RAY = "2"  # tests/serving.py: run with the modules of this group

pytestmark = pytest.mark.ray  # starts Ray, so also slow (tests/suite_plugin.py)

DEADLINE_S = 120  # a hang fails as DEADLINE_EXCEEDED instead of blocking the suite


def _long_stream(served, prompt: str):
    request = pb.GenerateRequest(
        prompt=prompt, params=pb.SamplingParams(max_tokens=1500, ignore_eos=True))
    return served.stub.Generate(request, metadata=served.metadata, timeout=DEADLINE_S)


def _wait_for_waiting(handle, count: int, timeout_s: float = 30) -> None:
    waiting = poll(lambda: handle.status.remote().result()["waiting"], lambda n: n >= count,
                   timeout_s, 0.05)
    assert waiting >= count, "the second request never queued"


def test_full_admission_queue_then_shutdown_through_the_proxy():
    app = {"kv_cache_memory": "256MiB", "max_num_seqs": 1, "max_waiting_requests": 1,
           "graceful_shutdown_timeout_s": 1}
    with serve_locally(app) as served:
        running = _long_stream(served, "Count to a thousand:")
        next(running)  # decoding: the one sequence slot is taken
        waiting_codes: list[grpc.StatusCode] = []
        waiter = threading.Thread(target=_drain_into, daemon=True,
                                  args=(_long_stream(served, "Name every river:"), waiting_codes))
        waiter.start()
        _wait_for_waiting(served.handle, 1)

        with pytest.raises(grpc.RpcError) as err:
            next(_long_stream(served, "One too many"))
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "max_waiting_requests" in err.value.details()
        assert len(next(running).token_ids) == 1  # the admitted stream is undisturbed

        from ray import serve

        serve.delete(served.app, _blocking=False)  # Serve waits 1 s, then the replica shuts down
        running_codes: list[grpc.StatusCode] = []
        _drain_into(running, running_codes)
        waiter.join(DEADLINE_S)
        assert running_codes == waiting_codes == [grpc.StatusCode.UNAVAILABLE]


def _drain_into(stream, codes: list) -> None:
    try:
        for _ in stream:
            pass
        codes.append(grpc.StatusCode.OK)
    except grpc.RpcError as err:
        codes.append(err.code())
