"""OpenTelemetry request spans, as vLLM exports them with `--otlp-traces-endpoint`: one span per
request, with a child for each stretch of its life (queued, prefill, decode, and each
preemption), built from the engine's timeline once the request ends, and exported over
OTLP/gRPC. A caller's W3C `traceparent` (gRPC metadata or HTTP header) makes the request span
its child, so the engine's time shows inside the caller's trace.

Span names and attributes follow OpenTelemetry's gen_ai conventions where they exist
(`gen_ai.request.id`, `gen_ai.usage.*`, `gen_ai.latency.*`); the rest are `kvserve.*`.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Mapping
from typing import Any

from kvserve.workers.core.outputs import RequestOutput
from kvserve.workers.core.timeline import RequestTimeline, TimelineEvent

SERVICE_NAME = "kvserve"


class RequestTracer:
    """Spans for ended requests, sent to `endpoint` (host:port of an OTLP/gRPC receiver, or
    http://host:port) in batches by a background thread."""

    def __init__(self, endpoint: str, service_name: str = SERVICE_NAME,
                 insecure: bool = True) -> None:
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        self.endpoint = endpoint
        self.provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
        self.provider.add_span_processor(BatchSpanProcessor(
            OTLPSpanExporter(endpoint=endpoint, insecure=insecure)))
        self.tracer = self.provider.get_tracer("kvserve.engine")
        self.propagator = TraceContextTextMapPropagator()

    def export(self, last: RequestOutput, carrier: Mapping[str, str] | None = None,
               attributes: Mapping[str, Any] | None = None) -> None:
        """The spans of a request that ended (`last`: its final output, with its timeline);
        `carrier` holds the caller's `traceparent` (and `tracestate`), if any."""
        from opentelemetry.trace import SpanKind, set_span_in_context

        timeline = last.timeline
        if timeline is None or not timeline.events:
            return
        parent = self.propagator.extract(dict(carrier or {}))
        ns = _clock(timeline)
        events = timeline.events
        root = self.tracer.start_span(
            "llm_request", context=parent, kind=SpanKind.SERVER, start_time=ns(events[0].start),
            attributes={**_request_attributes(last), **dict(attributes or {})})
        inside = set_span_in_context(root)
        for name, start, end, attrs in stretches(timeline):
            span = self.tracer.start_span(name, context=inside, start_time=ns(start),
                                          attributes=attrs)
            span.end(end_time=ns(end))
        for e in events:
            if e.kind in ("swapped_out", "swapped_in", "first_token"):
                root.add_event(e.kind, {"kvserve.blocks": e.blocks} if e.blocks else {},
                               timestamp=ns(e.start))
        root.end(end_time=ns(events[-1].end if events[-1].end is not None
                             else events[-1].start))

    def flush(self, timeout_s: float = 10.0) -> bool:
        return self.provider.force_flush(int(timeout_s * 1000))

    def shutdown(self) -> None:
        self.provider.shutdown()


async def traced(outputs: AsyncIterator[RequestOutput], tracer: RequestTracer | None,
                 trace: Mapping[str, str] | None = None) -> AsyncIterator[RequestOutput]:
    """Re-yield an engine output stream; once it ends, export its request's spans (nothing
    without a tracer). Closing this stream closes `outputs`."""
    async with contextlib.aclosing(outputs):
        async for out in outputs:
            if out.finished and tracer is not None:
                tracer.export(out, trace)
            yield out


def trace_context(metadata: Mapping[str, str]) -> dict[str, str]:
    """The W3C trace context among a call's gRPC metadata or HTTP headers (lower-case keys)."""
    return {k: metadata[k] for k in ("traceparent", "tracestate") if k in metadata}


def _clock(timeline: RequestTimeline):
    def ns(t: float) -> int:
        return int((t + timeline.wall_offset) * 1e9)
    return ns


def _request_attributes(last: RequestOutput) -> dict[str, Any]:
    attrs: dict[str, Any] = {"gen_ai.request.id": last.request_id,
                             "kvserve.finish_reason": last.finish_reason or ""}
    usage = last.usage
    if usage is not None:
        attrs |= {"gen_ai.usage.input_tokens": usage.prompt_tokens,
                  "gen_ai.usage.output_tokens": usage.completion_tokens,
                  "kvserve.cached_tokens": usage.cached_tokens}
        if usage.time_to_first_token_ms is not None:
            attrs["gen_ai.latency.time_to_first_token"] = usage.time_to_first_token_ms / 1000
    return attrs


def stretches(timeline: RequestTimeline) -> list[tuple[str, float, float, dict[str, Any]]]:
    """The request's life as consecutive child spans: (name, start, end, attributes) for
    "queued", "prefill" (its chunks), "decode" and each "preempted" wait."""
    out: list[tuple[str, float, float, dict[str, Any]]] = []
    waiting: TimelineEvent | None = None
    run: list[TimelineEvent] = []  # consecutive prefill or decode events

    def close_run() -> None:
        if run:
            kind = run[0].kind
            attrs: dict[str, Any] = {"kvserve.steps": len(run),
                                     "kvserve.tokens": sum(e.num_tokens for e in run)}
            if kind == "decode":
                attrs["kvserve.mean_batch_size"] = sum(e.batch_size for e in run) / len(run)
            out.append((kind, run[0].start, run[-1].end or run[-1].start, attrs))
            run.clear()

    for e in timeline.events:
        if e.kind in ("arrived", "preempted"):
            close_run()
            waiting = e
        elif e.kind in ("admitted", "resumed", "finished") and waiting is not None:
            name = "queued" if waiting.kind == "arrived" else "preempted"
            attrs = {"kvserve.mode": waiting.detail} if waiting.detail else {}
            out.append((name, waiting.start, e.start, attrs))
            waiting = None
        if e.kind in ("prefill", "decode"):
            if run and run[0].kind != e.kind:
                close_run()
            run.append(e)
    close_run()
    return out
