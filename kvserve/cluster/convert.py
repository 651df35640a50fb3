"""Translation between the gRPC messages (kvserve.v1) and the engine's dataclasses."""

from __future__ import annotations

from typing import Any

import grpc
from google.protobuf import struct_pb2

from kvserve.cluster.auth import AuthError, RateLimited
from kvserve.v1 import generation_pb2 as pb
from kvserve.workers.core.outputs import RequestOutput
from kvserve.workers.errors import EngineShutdownError, InvalidRequestError, QueueFullError

_OPTIONAL = ("max_tokens", "temperature", "top_p", "top_k", "min_p", "repetition_penalty",
             "presence_penalty", "frequency_penalty", "seed", "logprobs", "speculate")
_FINISH = {"stop": pb.FINISH_REASON_STOP, "length": pb.FINISH_REASON_LENGTH,
           "abort": pb.FINISH_REASON_ABORT}


def engine_request(request: pb.GenerateRequest) -> dict[str, Any]:
    """Keyword arguments for `LLMEngine.make_sequence` / `AsyncLLMEngine.generate`."""
    kwargs: dict[str, Any] = {"params": sampling_params(request.params)}
    kwargs |= prompt_input(request)
    if request.request_id:
        kwargs["request_id"] = request.request_id
    if request.cache_salt:
        kwargs["cache_salt"] = request.cache_salt
    return kwargs


def prompt_input(request: pb.GenerateRequest | pb.TokenizeRequest) -> dict[str, Any]:
    kind = request.WhichOneof("input")
    if kind is None:
        raise InvalidRequestError(
            "prompt", "give exactly one of prompt, prompt_token_ids, messages"
        )
    if kind == "prompt":
        return {"prompt": request.prompt}
    if kind == "prompt_token_ids":
        return {"prompt_token_ids": list(request.prompt_token_ids.ids)}
    return {"messages": [{"role": m.role, "content": m.content}
                         for m in request.messages.messages]}


def sampling_params(params: pb.SamplingParams) -> dict[str, Any]:
    """Only the fields the client set: unset ones keep the engine's documented defaults."""
    values: dict[str, Any] = {name: getattr(params, name) for name in _OPTIONAL
                              if params.HasField(name)}
    if params.stop:
        values["stop"] = list(params.stop)
    if params.stop_token_ids:
        values["stop_token_ids"] = list(params.stop_token_ids)
    if params.ignore_eos:
        values["ignore_eos"] = True
    if params.HasField("structured_outputs"):
        values["structured_outputs"] = structured_outputs(params.structured_outputs)
    return values


def structured_outputs(msg: pb.StructuredOutputs) -> dict[str, Any]:
    """The engine's `structured_outputs` dict ({} when no constraint is set: refused by the
    engine's validation, naming the field)."""
    kind = msg.WhichOneof("constraint")
    if kind == "json_schema":
        return {"json": msg.json_schema}
    if kind == "choice":
        return {"choice": list(msg.choice.choices)}
    return {kind: getattr(msg, kind)} if kind else {}


def response(out: RequestOutput, with_timeline: bool = False) -> pb.GenerateResponse:
    msg = pb.GenerateResponse(request_id=out.request_id, token_ids=out.token_ids, text=out.text)
    for lp in out.logprobs:
        msg.logprobs.append(pb.TokenLogprob(
            token_id=lp.token_id, logprob=lp.logprob,
            top=[pb.TopLogprob(token_id=t, logprob=v) for t, v in lp.top]))
    if out.finish_reason is not None:
        msg.finish_reason = _FINISH[out.finish_reason]
    if out.usage is not None:
        msg.usage.CopyFrom(pb.Usage(
            prompt_tokens=out.usage.prompt_tokens, completion_tokens=out.usage.completion_tokens,
            time_to_first_token_ms=out.usage.time_to_first_token_ms or 0.0,
            cached_tokens=out.usage.cached_tokens, draft_tokens=out.usage.draft_tokens,
            accepted_draft_tokens=out.usage.accepted_draft_tokens))
    if with_timeline and out.timeline is not None:
        msg.timeline.CopyFrom(timeline(out.timeline.as_dict()["events"]))
    return msg


def timeline(events: list[dict[str, Any]]) -> pb.Timeline:
    """`RequestTimeline.as_dict()["events"]` as the message (the same names)."""
    return pb.Timeline(events=[pb.TimelineEvent(**e) for e in events])


def struct(values: dict[str, Any]) -> struct_pb2.Struct:
    msg = struct_pb2.Struct()
    msg.update(values)
    return msg


def status_code(exc: BaseException) -> grpc.StatusCode:
    """The gRPC status for an error raised while serving a request."""
    codes = {AuthError: grpc.StatusCode.UNAUTHENTICATED,
             RateLimited: grpc.StatusCode.RESOURCE_EXHAUSTED,
             InvalidRequestError: grpc.StatusCode.INVALID_ARGUMENT,
             QueueFullError: grpc.StatusCode.RESOURCE_EXHAUSTED,
             EngineShutdownError: grpc.StatusCode.UNAVAILABLE}
    return next((code for kind, code in codes.items() if isinstance(exc, kind)),
                grpc.StatusCode.INTERNAL)
