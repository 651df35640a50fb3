"""Locust users that stream kvserve's `Generate` over gRPC (not HTTP).

    locust -f kvserve/bench/locust/locustfile.py --host 127.0.0.1:50051 [ShortChatUser ...]

Each stream reports to Locust's stats through request events (request_type "grpc"):
`TTFT` (time to first token), `stream` (the whole stream; response_length = output tokens),
`ITL` (the stream's mean inter-token latency, ms) and `output tok/s` (the stream's output tokens
per second, shown in Locust's time columns). A failed stream is a `stream` failure named after its
gRPC status code (e.g. RESOURCE_EXHAUSTED). One channel per user, reused across its requests.
Workloads: ShortChatUser, LongPromptUser, MixedUser, MultiTurnUser (tags short, long, mixed,
multiturn), each seeded. Load shapes: KVSERVE_SHAPE=steady|ramp|spike (see shapes.py).
A user whose stream was refused (RESOURCE_EXHAUSTED, UNAVAILABLE) backs off exponentially with
jitter before its next request, as gRPC's retry policy would (KVSERVE_BACKOFF_S, default 0.5 s,
doubling up to 8 s); KVSERVE_TIMEOUT_S is each stream's deadline (default 600 s).
KVSERVE_TOKENS_FILE, if set, receives the totals (output tokens, streams, each failure's
latency by status, and the raw TTFT and per-token ITL samples in ms) for `kvserve loadtest`,
which takes its p50/p99 from those samples with the percentile `kvserve bench serve` uses
(Locust's own columns come from its rounded response-time histogram).
"""

from __future__ import annotations

import itertools
import json
import os
import random
import sys
import time
from pathlib import Path

import gevent
import grpc.experimental.gevent as grpc_gevent

grpc_gevent.init_gevent()  # before any channel: gRPC's I/O on gevent, as Locust needs
# Under gevent, gRPC waits for each call's next message on the hub's native thread pool (10
# threads by default). A user waiting for its first token holds a thread, so with more users
# than threads a refusal waited behind other users' prefills: client-side refusal p99 was 12 s
# while the replica refused in ~20 ms. Threads start on demand, so a high cap costs nothing.
CLIENT_THREADS = 1024
gevent.get_hub().threadpool.maxsize = CLIENT_THREADS

import grpc  # noqa: E402
from locust import User, events, tag, task  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

import shapes  # noqa: E402
import workloads  # noqa: E402

from cluster.client import backoff_s  # noqa: E402
from kvserve.v1 import generation_pb2 as pb  # noqa: E402
from kvserve.v1 import generation_pb2_grpc as pb_grpc  # noqa: E402

METADATA = (("application", os.environ.get("KVSERVE_APPLICATION", "kvserve")),)
SEED = int(os.environ.get("KVSERVE_SEED", "0"))
TIMEOUT_S = float(os.environ.get("KVSERVE_TIMEOUT_S", "600"))
BACKOFF_S = float(os.environ.get("KVSERVE_BACKOFF_S", "0.5"))
RETRYABLE = {"RESOURCE_EXHAUSTED", "UNAVAILABLE"}
# failure_ms: status -> [ms]; ttft_ms: one sample per stream; itl_ms: one per token after the
# first message's (k tokens after a gap g: k samples of g / k, as `kvserve bench serve` counts)
TOTALS: dict = {"output_tokens": 0, "streams": 0, "failure_ms": {}, "ttft_ms": [], "itl_ms": []}
_USER_NUMBERS = itertools.count()  # seeds users by spawn order, so runs repeat

if os.environ.get("KVSERVE_SHAPE"):
    LoadShape = shapes.by_name(os.environ["KVSERVE_SHAPE"])  # Locust uses a shape it finds here


class GrpcStreamError(Exception):
    """A failed stream, named by its gRPC status code (Locust groups failures by message)."""


class KvserveUser(User):
    abstract = True

    def on_start(self) -> None:
        self.channel = grpc.insecure_channel(self.host)
        self.stub = pb_grpc.GenerationStub(self.channel)
        self.rng = random.Random(f"{SEED}:{type(self).__name__}:{next(_USER_NUMBERS)}")
        self.refusals = 0  # consecutive refused streams, for the backoff

    def wait_time(self) -> float:
        if not self.refusals:
            return 0.0
        return backoff_s(self.refusals, self.rng, BACKOFF_S)

    def on_stop(self) -> None:
        self.channel.close()

    def stream(self, request: workloads.Request) -> str:
        """Send one Generate, report it to Locust; returns the text."""
        message = _to_proto(request)
        start = last = time.perf_counter()
        gaps, tokens, text, ttft = [], 0, [], None
        try:
            for response in self.stub.Generate(message, metadata=METADATA, timeout=TIMEOUT_S):
                now = time.perf_counter()
                if response.token_ids:
                    if ttft is None:
                        ttft = now - start
                        _fire("TTFT", ttft, 0)
                        TOTALS["ttft_ms"].append(round(1000 * ttft, 3))
                    else:
                        gaps.append((now - last) / len(response.token_ids))
                        TOTALS["itl_ms"] += [round(1000 * gaps[-1], 3)] * len(response.token_ids)
                    tokens += len(response.token_ids)
                    last = now
                text.append(response.text)
        except grpc.RpcError as exc:
            self._failed(exc.code().name, time.perf_counter() - start, tokens)
            return ""
        finally:
            TOTALS["output_tokens"] += tokens
        self.refusals = 0
        _report_stream(time.perf_counter() - start, tokens, gaps)
        return "".join(text)

    def _failed(self, status: str, seconds: float, tokens: int) -> None:
        _fire("stream", seconds, tokens, GrpcStreamError(status))
        TOTALS["failure_ms"].setdefault(status, []).append(1000 * seconds)
        self.refusals = self.refusals + 1 if status in RETRYABLE else 0


def _report_stream(total_s: float, tokens: int, gaps: list[float]) -> None:
    TOTALS["streams"] += 1
    _fire("stream", total_s, tokens)
    if gaps:
        events.request.fire(request_type="grpc", name="ITL", response_time=1000 * sum(gaps)
                            / len(gaps), response_length=len(gaps), exception=None, context={})
    if total_s > 0:
        events.request.fire(request_type="grpc", name="output tok/s",
                            response_time=tokens / total_s, response_length=tokens,
                            exception=None, context={})


def _fire(name: str, seconds: float, length: int, exception: Exception | None = None) -> None:
    events.request.fire(request_type="grpc", name=name, response_time=1000 * seconds,
                        response_length=length, exception=exception, context={})


def _to_proto(request: workloads.Request) -> pb.GenerateRequest:
    message = pb.GenerateRequest(params=pb.SamplingParams(**request.params))
    if request.messages is not None:
        message.messages.messages.extend(pb.ChatMessage(**m) for m in request.messages)
    else:
        message.prompt = request.prompt
    return message


class ShortChatUser(KvserveUser):
    @tag("short")
    @task
    def short_chat(self) -> None:
        self.stream(workloads.short_chat(self.rng))


class LongPromptUser(KvserveUser):
    @tag("long")
    @task
    def long_prompt(self) -> None:
        self.stream(workloads.long_prompt(self.rng))


class MixedUser(KvserveUser):
    @tag("mixed")
    @task
    def mixed(self) -> None:
        self.stream(workloads.mixed(self.rng))


class MultiTurnUser(KvserveUser):
    def on_start(self) -> None:
        super().on_start()
        self.conversation = workloads.Conversation(self.rng)

    @tag("multiturn")
    @task
    def next_turn(self) -> None:
        self.conversation.answered(self.stream(self.conversation.next_request()))


@events.quitting.add_listener
def _write_totals(environment, **_kwargs) -> None:
    path = os.environ.get("KVSERVE_TOKENS_FILE")
    if path:
        Path(path).write_text(json.dumps(TOTALS))
