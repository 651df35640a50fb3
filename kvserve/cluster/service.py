"""The Generation service over one engine, shaped the way Ray Serve's gRPC proxy calls it:
one method per RPC taking the request message; `Generate` is an async generator.

`add_to_server` also mounts it on a plain `grpc.aio` server (a single-process server, and the
real-gRPC tests), mapping errors to status codes with a message that names the field.

Streaming: with `stream_coalesce_ms` 0 every engine output is one message. With a window > 0,
outputs that arrive within that many milliseconds of the first pending one (and any already
queued behind a slow consumer) leave as one merged message, so fewer messages cross the proxy.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping, Sequence

import grpc

from kvserve.cluster.coalesce import coalesce
from kvserve.cluster.convert import engine_request, prompt_input, response, status_code, struct
from kvserve.cluster.tracing import RequestTracer, trace_context, traced
from kvserve.v1 import generation_pb2 as pb
from kvserve.v1 import generation_pb2_grpc as pb_grpc
from kvserve.workers.async_engine import AsyncLLMEngine, Observer, unobserved


class GenerationService:
    def __init__(self, engine: AsyncLLMEngine, replicas: int = 1,
                 stream_coalesce_ms: float = 0.0, observe: Observer | None = None,
                 tracer: RequestTracer | None = None) -> None:
        """`observe` wraps each request's engine output stream (the replica's metrics);
        `tracer` exports each ended request's spans (OpenTelemetry)."""
        if stream_coalesce_ms < 0:
            raise ValueError("stream_coalesce_ms must be >= 0")
        self.engine = engine
        self.observe = observe or unobserved
        self.replicas = replicas
        self.stream_coalesce_ms = stream_coalesce_ms
        self.tracer = tracer

    async def Generate(self, request: pb.GenerateRequest,  # noqa: N802
                       trace: Mapping[str, str] | None = None,
                       ) -> AsyncIterator[pb.GenerateResponse]:
        """`trace`: the caller's W3C trace context (`traceparent`), the parent of the
        request's span when a tracer is set."""
        outputs = self.observe(self.engine.generate(**engine_request(request)))
        if self.tracer is not None:
            outputs = traced(outputs, self.tracer, trace)
        with_timeline = request.return_timeline
        if self.stream_coalesce_ms <= 0:
            async for out in outputs:
                yield response(out, with_timeline)
            return
        messages = (response(out, with_timeline) async for out in outputs)
        async for msg in coalesce(messages, self.stream_coalesce_ms / 1000, merge_responses):
            yield msg

    async def ModelInfo(self, request: pb.ModelInfoRequest) -> pb.ModelInfoResponse:  # noqa: N802
        info = self.engine.info
        return pb.ModelInfoResponse(
            model=info.name, max_model_len=info.max_model_len, vocab_size=info.vocab_size,
            rope_parameters=struct(info.rope_parameters), replicas=self.replicas,
        )

    async def Tokenize(self, request: pb.TokenizeRequest) -> pb.TokenizeResponse:  # noqa: N802
        ids = self.engine.tokenize(**prompt_input(request))
        return pb.TokenizeResponse(token_ids=ids, count=len(ids))


def merge_responses(messages: Sequence[pb.GenerateResponse]) -> pb.GenerateResponse:
    """One message for consecutive messages of one stream: token_ids, text and logprobs
    concatenated; request_id, finish_reason, usage and timeline from the last."""
    if len(messages) == 1:
        return messages[0]
    last = messages[-1]
    merged = pb.GenerateResponse(request_id=last.request_id, finish_reason=last.finish_reason,
                                 text="".join(m.text for m in messages))
    for m in messages:
        merged.token_ids.extend(m.token_ids)
        merged.logprobs.extend(m.logprobs)
    if last.HasField("usage"):
        merged.usage.CopyFrom(last.usage)
    if last.HasField("timeline"):
        merged.timeline.CopyFrom(last.timeline)
    return merged


class _Servicer(pb_grpc.GenerationServicer):
    """Adapts GenerationService to grpc.aio: exceptions become status codes."""

    def __init__(self, service: GenerationService) -> None:
        self.service = service

    async def Generate(self, request, context: grpc.aio.ServicerContext):  # noqa: N802
        try:
            metadata = dict(context.invocation_metadata() or ())
            async for msg in self.service.Generate(request, trace_context(metadata)):
                yield msg
        except Exception as exc:  # noqa: BLE001 - every error leaves as a status, never a hang
            await context.abort(status_code(exc), str(exc))

    async def ModelInfo(self, request, context: grpc.aio.ServicerContext):  # noqa: N802
        return await self.service.ModelInfo(request)

    async def Tokenize(self, request, context: grpc.aio.ServicerContext):  # noqa: N802
        try:
            return await self.service.Tokenize(request)
        except Exception as exc:  # noqa: BLE001
            await context.abort(status_code(exc), str(exc))


def add_to_server(service: GenerationService, server: grpc.aio.Server) -> None:
    pb_grpc.add_GenerationServicer_to_server(_Servicer(service), server)
