"""The Locust users' gRPC client under gevent: a refusal reaches its user at once even while more
users than gevent's default thread pool (10) wait on slow streams, and a refused user backs off.
A real gRPC server (threads) and the locustfile's own gevent set-up, in a subprocess as Locust
runs it."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from concurrent import futures
from pathlib import Path

import grpc

from kvserve.cluster.local_head import free_port
from kvserve.v1 import generation_pb2 as pb
from kvserve.v1 import generation_pb2_grpc as pb_grpc

ROOT = Path(__file__).resolve().parents[1]
HOLD_S = 10.0  # a held stream's first token comes this late (a long prefill)
HELD_STREAMS = 16  # more than gevent's default 10 threads

CLIENT = f"""
import sys, time
sys.path.insert(0, {str(ROOT / "kvserve" / "bench" / "locust")!r})
import locustfile  # gevent + gRPC set up exactly as under Locust
import gevent, grpc
from kvserve.v1 import generation_pb2 as pb, generation_pb2_grpc as pb_grpc

def call(prompt):
    stub = pb_grpc.GenerationStub(grpc.insecure_channel(sys.argv[1]))
    start = time.perf_counter()
    try:
        for _ in stub.Generate(pb.GenerateRequest(prompt=prompt), timeout=60):
            pass
    except grpc.RpcError as exc:
        return exc.code().name, time.perf_counter() - start
    return "OK", time.perf_counter() - start

held = [gevent.spawn(call, "hold") for _ in range({HELD_STREAMS})]
gevent.sleep(1.0)  # every held stream is waiting for its first message
code, seconds = call("refuse")
print(code, round(seconds, 3), flush=True)
gevent.joinall(held)
print(sorted({{c for c, _ in (g.value for g in held)}}), flush=True)
"""


class HoldOrRefuse(pb_grpc.GenerationServicer):
    """Holds every stream until `release` (at most HOLD_S) and refuses the prompt "refuse",
    noting how many streams it was holding then."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.lock = threading.Lock()
        self.holding = 0
        self.holding_at_refusal: int | None = None

    def Generate(self, request, context):
        if request.prompt == "refuse":
            with self.lock:
                self.holding_at_refusal = self.holding
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "queue full")
        with self.lock:
            self.holding += 1
        self.release.wait(HOLD_S)
        with self.lock:
            self.holding -= 1
        yield pb.GenerateResponse(token_ids=[1], text="x")


def test_a_refusal_reaches_its_user_while_many_others_wait_for_first_tokens():
    """While 16 streams wait for their first token (more than gevent's default pool of 10
    threads), a refused request's error reaches its user within 2 s; the held streams are let go
    once it has. Negative control, by hand: without the locustfile's larger pool
    (`threadpool.maxsize`), the refusal waits ~9 s behind them."""
    servicer = HoldOrRefuse()
    server = grpc.server(futures.ThreadPoolExecutor(HELD_STREAMS + 4))
    pb_grpc.add_GenerationServicer_to_server(servicer, server)
    port = free_port()
    server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    client = subprocess.Popen([sys.executable, "-c", CLIENT, f"127.0.0.1:{port}"], cwd=ROOT,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        refusal = client.stdout.readline()  # the held streams are released only after it
        servicer.release.set()
        rest, err = client.communicate(timeout=120)
        assert client.returncode == 0, err[-3000:]
    finally:
        servicer.release.set()
        client.kill()
        server.stop(0)
    code, seconds = refusal.split()
    assert code == "RESOURCE_EXHAUSTED"
    assert float(seconds) < 2.0, f"refusal took {seconds} s behind {HELD_STREAMS} held streams"
    assert servicer.holding_at_refusal == HELD_STREAMS  # all were really held meanwhile
    assert rest.splitlines()[-1] == "['OK']"  # and then all completed


def test_every_workload_builds_its_requests():
    """Each Locust workload makes a request from its seeded generator (the mixed workload read
    its prose from a path that a package move had broken, and every `kvserve loadtest` with the
    default workload failed in its users)."""
    import random

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "kvserve" / "bench" / "locust"))
    import workloads

    rng = random.Random(0)
    for make in (workloads.short_chat, workloads.long_prompt, workloads.mixed):
        request = make(rng)
        assert request.params["max_tokens"] > 0
        assert (request.prompt is None) != (request.messages is None)
    assert workloads.Conversation(rng).next_request().messages


USER = f"""
import json, random, sys
sys.path.insert(0, {str(ROOT / "kvserve" / "bench" / "locust")!r})
import locustfile, workloads

# the user's own methods, without a Locust environment to spawn it in
user = object.__new__(locustfile.KvserveUser)
user.refusals, user.rng = 0, random.Random(0)
user.transport = locustfile.GrpcTransport(sys.argv[1])
waits = []
for prompt in ("refuse", "refuse", "refuse", "serve", "refuse"):
    user.stream(workloads.Request(params={{}}, prompt=prompt))
    waits.append(user.wait_time())
print(json.dumps([waits, sorted(locustfile.TOTALS["failure_ms"]), locustfile.TOTALS["streams"]]))
"""


class RefuseOrServe(pb_grpc.GenerationServicer):
    def Generate(self, request, context):
        if request.prompt == "refuse":
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "queue full")
        yield pb.GenerateResponse(token_ids=[1], text="x")


def test_a_refused_user_backs_off_exponentially_and_not_after_a_stream_it_got():
    """A Locust user refused (RESOURCE_EXHAUSTED) waits 0.5 s x 2^(n-1), with jitter (x0.5-1),
    before its next request; a stream it gets resets the backoff (no wait), and the next refusal
    starts again at 0.5 s. Negative control: a user that did not back off would wait 0 after
    each refusal."""
    server = grpc.server(futures.ThreadPoolExecutor(4))
    pb_grpc.add_GenerationServicer_to_server(RefuseOrServe(), server)
    port = free_port()
    server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    try:
        done = subprocess.run([sys.executable, "-c", USER, f"127.0.0.1:{port}"], cwd=ROOT,
                              capture_output=True, text=True, timeout=120)
    finally:
        server.stop(0)
    assert done.returncode == 0, done.stderr[-3000:]
    waits, statuses, streams = json.loads(done.stdout.strip().splitlines()[-1])
    assert 0.25 <= waits[0] <= 0.5 and 0.5 <= waits[1] <= 1.0 and 1.0 <= waits[2] <= 2.0, waits
    assert waits[3] == 0.0, waits  # served: no backoff
    assert 0.25 <= waits[4] <= 0.5, waits  # refused again: from the start
    assert statuses == ["RESOURCE_EXHAUSTED"] and streams == 1
