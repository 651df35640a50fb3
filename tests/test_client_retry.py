"""`Client.generate` retries a refused request (RESOURCE_EXHAUSTED before any response) with
backoff, and nothing else: a real gRPC server whose servicer refuses on cue."""

from __future__ import annotations

from concurrent import futures

import grpc
import pytest

from kvserve.cluster.client import Client, backoff_s
from kvserve.cluster.local_head import free_port
from kvserve.v1 import generation_pb2 as pb
from kvserve.v1 import generation_pb2_grpc as pb_grpc


class Scripted(pb_grpc.GenerationServicer):
    """Answers call i with `script[i]`: a status code to fail with (after `tokens` messages)."""

    def __init__(self, script: list[grpc.StatusCode | None], tokens: int = 0) -> None:
        self.script, self.tokens, self.calls = script, tokens, 0

    def Generate(self, request, context):
        code = self.script[min(self.calls, len(self.script) - 1)]
        self.calls += 1
        for i in range(self.tokens if code else 2):
            yield pb.GenerateResponse(token_ids=[i], text=str(i))
        if code is not None:
            context.abort(code, "scripted")


@pytest.fixture
def serve():
    servers = []

    def start(servicer: Scripted) -> Client:
        server = grpc.server(futures.ThreadPoolExecutor(4))
        pb_grpc.add_GenerationServicer_to_server(servicer, server)
        port = free_port()
        server.add_insecure_port(f"127.0.0.1:{port}")
        server.start()
        servers.append(server)
        return Client(f"127.0.0.1:{port}")

    yield start
    for server in servers:
        server.stop(0)


REFUSED = grpc.StatusCode.RESOURCE_EXHAUSTED


def test_refusals_are_retried_until_admitted(serve):
    servicer = Scripted([REFUSED, REFUSED, None])
    out = list(serve(servicer).generate("hi", retry_refused_s=30))
    assert [r.text for r in out] == ["0", "1"] and servicer.calls == 3


def test_without_a_retry_budget_or_for_other_codes_the_error_is_raised(serve):
    for script, retry_s in (([REFUSED, None], 0.0),
                            ([grpc.StatusCode.INVALID_ARGUMENT, None], 30.0)):
        servicer = Scripted(script)
        with pytest.raises(grpc.RpcError) as err:
            list(serve(servicer).generate("hi", retry_refused_s=retry_s))
        assert err.value.code() == script[0] and servicer.calls == 1


def test_a_stream_that_already_answered_is_never_retried(serve):
    servicer = Scripted([REFUSED, None], tokens=1)  # a response, then the error
    with pytest.raises(grpc.RpcError):
        list(serve(servicer).generate("hi", retry_refused_s=30))
    assert servicer.calls == 1


def test_backoff_doubles_to_a_cap_with_jitter():
    import random

    rng = random.Random(0)
    waits = [backoff_s(n, rng) for n in range(1, 8)]
    assert all(0.5 * c <= w <= c for w, c in zip(waits, [0.5, 1, 2, 4, 8, 8, 8], strict=True))
