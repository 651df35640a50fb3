"""A real OTLP/gRPC trace receiver for tests: opentelemetry-proto's TraceService on loopback,
what a collector or Jaeger listens with. It keeps every span it is sent."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

CALLER_TRACE_ID, CALLER_SPAN_ID = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
CALLER_TRACEPARENT = f"00-{CALLER_TRACE_ID}-{CALLER_SPAN_ID}-01"  # W3C trace context


class Receiver(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self) -> None:
        self.spans: list = []
        self.endpoint = ""

    def Export(self, request, context):  # noqa: N802 - the RPC's name
        for resource in request.resource_spans:
            for scope in resource.scope_spans:
                self.spans.extend(scope.spans)
        return trace_service_pb2.ExportTraceServiceResponse()

    def request_spans(self) -> dict[str, tuple]:
        """gen_ai.request.id -> (its llm_request span, that span's attributes)."""
        out = {}
        for span in self.spans:
            if span.name == "llm_request":
                attrs = {a.key: a.value for a in span.attributes}
                out[attrs["gen_ai.request.id"].string_value] = (span, attrs)
        return out

    def children(self, span) -> list:
        return [s for s in self.spans if s.parent_span_id == span.span_id]


@contextlib.contextmanager
def otlp_receiver() -> Iterator[Receiver]:
    receiver = Receiver()
    server = grpc.server(ThreadPoolExecutor(2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(receiver, server)
    receiver.endpoint = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
    server.start()
    try:
        yield receiver
    finally:
        server.stop(None)
