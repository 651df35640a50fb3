"""Locust users that stream from kvserve over gRPC (`Generate`) or its OpenAI-compatible HTTP
API (`/v1/completions`, `/v1/chat/completions`, server-sent events): KVSERVE_PROTOCOL=grpc|http.

    locust -f kvserve/bench/locust/locustfile.py --host 127.0.0.1:50051 [ShortChatUser ...]
    KVSERVE_PROTOCOL=http locust -f ... --host http://127.0.0.1:8000 [ShortChatUser ...]

KVSERVE_API_KEY, if set, is sent as the API key (gRPC metadata or HTTP header).
Each stream reports to Locust's stats through request events (request_type "grpc" or "http"):
`TTFT` (time to first token), `stream` (the whole stream; response_length = output tokens),
`ITL` (the stream's mean inter-token latency, ms) and `output tok/s` (the stream's output tokens
per second, shown in Locust's time columns). A failed stream is a `stream` failure named after its
gRPC status code (e.g. RESOURCE_EXHAUSTED) or HTTP status (HTTP_429). One channel (or HTTP
session) per user, reused across its requests.
Workloads: ShortChatUser, LongPromptUser, MixedUser, MultiTurnUser (tags short, long, mixed,
multiturn), each seeded. Load shapes: KVSERVE_SHAPE=steady|ramp|ramp-hold|spike (shapes.py;
KVSERVE_SPAWN_RATE, if set, is ramp-hold's rise in users per second).
A user whose stream was refused (RESOURCE_EXHAUSTED, UNAVAILABLE, HTTP 429 or 503) backs off
exponentially with
jitter before its next request, as gRPC's retry policy would (KVSERVE_BACKOFF_S, default 0.5 s,
doubling up to 8 s); KVSERVE_TIMEOUT_S is each stream's deadline (default 600 s).
KVSERVE_TOKENS_FILE, if set, receives the totals (output tokens, streams, each failure's
latency by status, the raw TTFT, per-token ITL and finished streams' end-to-end samples in ms,
and each stream's end: unix time and outcome, "OK" or the status) for `kvserve loadtest`, which
takes its p50/p99 from those samples with the percentile `kvserve bench serve` uses (Locust's
own columns come from its rounded response-time histogram).
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

from kvserve.cluster.client import backoff_s, call_metadata  # noqa: E402
from kvserve.cluster.http_client import base_url  # noqa: E402
from kvserve.v1 import generation_pb2 as pb  # noqa: E402
from kvserve.v1 import generation_pb2_grpc as pb_grpc  # noqa: E402

PROTOCOL = os.environ.get("KVSERVE_PROTOCOL", "grpc")
API_KEY = os.environ.get("KVSERVE_API_KEY") or None
METADATA = call_metadata(os.environ.get("KVSERVE_APPLICATION", "kvserve"), API_KEY)
SEED = int(os.environ.get("KVSERVE_SEED", "0"))
TIMEOUT_S = float(os.environ.get("KVSERVE_TIMEOUT_S", "600"))
BACKOFF_S = float(os.environ.get("KVSERVE_BACKOFF_S", "0.5"))
RETRYABLE = {"RESOURCE_EXHAUSTED", "UNAVAILABLE", "HTTP_429", "HTTP_503"}
# failure_ms: status -> [ms]; ttft_ms: one sample per stream; e2el_ms: one per stream that
# finished (request to last message, vLLM's end-to-end latency); itl_ms: one per token after the
# first message's (k tokens after a gap g: k samples of g / k, as `kvserve bench serve` counts);
# ends: [unix time, "OK" or the failure's status] per stream, for outcomes over time; start: the
# run's unix time
TOTALS: dict = {"output_tokens": 0, "streams": 0, "failure_ms": {}, "ttft_ms": [], "itl_ms": [],
                "e2el_ms": [], "ends": []}
_USER_NUMBERS = itertools.count()  # seeds users by spawn order, so runs repeat

if os.environ.get("KVSERVE_SHAPE"):
    LoadShape = shapes.by_name(os.environ["KVSERVE_SHAPE"])  # Locust uses a shape it finds here


class GrpcStreamError(Exception):
    """A failed stream, named by its gRPC status code or HTTP status (Locust groups failures
    by message)."""


class GrpcTransport:
    """`Generate` over one channel: (tokens, text) per message."""

    def __init__(self, host: str) -> None:
        self.channel = grpc.insecure_channel(host)
        self.stub = pb_grpc.GenerationStub(self.channel)

    def messages(self, request: workloads.Request):
        try:
            for response in self.stub.Generate(_to_proto(request), metadata=METADATA,
                                               timeout=TIMEOUT_S):
                yield len(response.token_ids), response.text
        except grpc.RpcError as exc:
            raise GrpcStreamError(exc.code().name) from None

    def close(self) -> None:
        self.channel.close()


class HttpTransport:
    """The OpenAI-compatible API over one HTTP session: (tokens, text) per SSE chunk, token
    counts from vLLM's `return_token_ids`."""

    def __init__(self, host: str) -> None:
        import requests  # here: after locust, which monkey-patches ssl for gevent first

        self.url = base_url(host)
        self.session = requests.Session()
        if API_KEY:
            self.session.headers["Authorization"] = f"Bearer {API_KEY}"

    def messages(self, request: workloads.Request):
        body = {**request.params, "stream": True, "return_token_ids": True}
        if request.messages is not None:
            path, body["messages"] = "/v1/chat/completions", request.messages
        else:
            path, body["prompt"] = "/v1/completions", request.prompt
        try:
            with self.session.post(self.url + path, json=body, stream=True,
                                   timeout=TIMEOUT_S) as response:
                if response.status_code != 200:
                    raise GrpcStreamError(f"HTTP_{response.status_code}")
                for line in response.iter_lines():
                    if not line.startswith(b"data: ") or line == b"data: [DONE]":
                        continue
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        raise GrpcStreamError(f"HTTP_STREAM_{chunk['error'].get('code')}")
                    for choice in chunk["choices"]:
                        text = choice.get("text") or (choice.get("delta") or {}).get("content")
                        yield len(choice.get("token_ids", [])), text or ""
        except OSError as exc:  # requests' errors (connection, timeout) are OSErrors
            raise GrpcStreamError(f"HTTP_{type(exc).__name__}") from None

    def close(self) -> None:
        self.session.close()


TRANSPORTS = {"grpc": GrpcTransport, "http": HttpTransport}


class KvserveUser(User):
    abstract = True

    def on_start(self) -> None:
        self.transport = TRANSPORTS[PROTOCOL](self.host)
        self.rng = random.Random(f"{SEED}:{type(self).__name__}:{next(_USER_NUMBERS)}")
        self.refusals = 0  # consecutive refused streams, for the backoff

    def wait_time(self) -> float:
        if not self.refusals:
            return 0.0
        return backoff_s(self.refusals, self.rng, BACKOFF_S)

    def on_stop(self) -> None:
        self.transport.close()

    def stream(self, request: workloads.Request) -> str:
        """Send one request, report it to Locust; returns the text."""
        start = last = time.perf_counter()
        gaps, tokens, text, ttft = [], 0, [], None
        try:
            for count, piece in self.transport.messages(request):
                now = time.perf_counter()
                if count:
                    if ttft is None:
                        ttft = now - start
                        _fire("TTFT", ttft, 0)
                        TOTALS["ttft_ms"].append(round(1000 * ttft, 3))
                    else:
                        gaps.append((now - last) / count)
                        TOTALS["itl_ms"] += [round(1000 * gaps[-1], 3)] * count
                    tokens += count
                    last = now
                text.append(piece)
        except GrpcStreamError as exc:
            self._failed(str(exc), time.perf_counter() - start, tokens)
            return ""
        finally:
            TOTALS["output_tokens"] += tokens
        self.refusals = 0
        _report_stream(time.perf_counter() - start, tokens, gaps)
        return "".join(text)

    def _failed(self, status: str, seconds: float, tokens: int) -> None:
        _fire("stream", seconds, tokens, GrpcStreamError(status))
        TOTALS["failure_ms"].setdefault(status, []).append(1000 * seconds)
        TOTALS["ends"].append([round(time.time(), 3), status])
        self.refusals = self.refusals + 1 if status in RETRYABLE else 0


def _report_stream(total_s: float, tokens: int, gaps: list[float]) -> None:
    TOTALS["streams"] += 1
    TOTALS["e2el_ms"].append(round(1000 * total_s, 3))
    TOTALS["ends"].append([round(time.time(), 3), "OK"])
    _fire("stream", total_s, tokens)
    if gaps:
        events.request.fire(request_type=PROTOCOL, name="ITL", response_time=1000 * sum(gaps)
                            / len(gaps), response_length=len(gaps), exception=None, context={})
    if total_s > 0:
        events.request.fire(request_type=PROTOCOL, name="output tok/s",
                            response_time=tokens / total_s, response_length=tokens,
                            exception=None, context={})


def _fire(name: str, seconds: float, length: int, exception: Exception | None = None) -> None:
    events.request.fire(request_type=PROTOCOL, name=name, response_time=1000 * seconds,
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


@events.test_start.add_listener
def _started(environment, **_kwargs) -> None:
    TOTALS["start"] = round(time.time(), 3)  # for the rate of `ends`


@events.quitting.add_listener
def _write_totals(environment, **_kwargs) -> None:
    path = os.environ.get("KVSERVE_TOKENS_FILE")
    if path:
        Path(path).write_text(json.dumps(TOTALS))
