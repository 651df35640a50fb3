"""A small Python client over the generated stubs: `Client` (sync) and `AsyncClient` (asyncio).

    with Client("127.0.0.1:50051") as client:
        for chunk in client.generate("Hello", max_tokens=32, temperature=0):
            print(chunk.text, end="")
"""

from __future__ import annotations

import json
import random
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import grpc

from kvserve.v1 import generation_pb2 as pb
from kvserve.v1 import generation_pb2_grpc as pb_grpc

DEFAULT_APPLICATION = "kvserve"
REFUSED = grpc.StatusCode.RESOURCE_EXHAUSTED


def backoff_s(attempt: int, rng: random.Random | None = None, base_s: float = 0.5,
              max_s: float = 8.0) -> float:
    """Seconds to wait before retry `attempt` (1, 2, ...) of a refused request: exponential,
    capped, with jitter so refused clients do not come back in step (gRPC's retry policy)."""
    return min(max_s, base_s * 2 ** (attempt - 1)) * (rng or random).uniform(0.5, 1)


def generate_request(
    prompt: str | None = None, *, prompt_token_ids: list[int] | None = None,
    messages: list[dict[str, str]] | None = None, request_id: str = "", cache_salt: str = "",
    **params: Any,
) -> pb.GenerateRequest:
    """`params` are SamplingParams fields (max_tokens, temperature, seed, stop, ...;
    `structured_outputs` as the engine takes it, e.g. {"json": schema}); `cache_salt` scopes
    prefix-cache reuse to one tenant."""
    constraint = params.pop("structured_outputs", None)
    request = pb.GenerateRequest(request_id=request_id, cache_salt=cache_salt,
                                 params=pb.SamplingParams(**params))
    if constraint is not None:
        request.params.structured_outputs.CopyFrom(structured_outputs_message(constraint))
    if prompt is not None:
        request.prompt = prompt
    if prompt_token_ids is not None:
        request.prompt_token_ids.ids.extend(prompt_token_ids)
    if messages is not None:
        request.messages.messages.extend(pb.ChatMessage(**m) for m in messages)
    return request


def structured_outputs_message(spec: dict[str, Any]) -> pb.StructuredOutputs:
    """{"json": schema} (a dict or its text), {"json_object": True}, {"regex": r},
    {"choice": [...]} or {"grammar": ebnf} as the proto's StructuredOutputs."""
    msg = pb.StructuredOutputs()
    for kind, value in spec.items():
        if kind == "json":
            msg.json_schema = value if isinstance(value, str) else json.dumps(value)
        elif kind == "choice":
            msg.choice.choices.extend(value)
        else:
            setattr(msg, kind, value)
    return msg


def finish_reason_name(code: int) -> str:
    """pb.FINISH_REASON_LENGTH -> "length" (the engine's own names)."""
    return pb.FinishReason.Name(code).removeprefix("FINISH_REASON_").lower()


def call_metadata(application: str, api_key: str | None) -> tuple[tuple[str, str], ...]:
    """The metadata of every call: the Serve application, and the API key if any."""
    auth = (("authorization", f"Bearer {api_key}"),) if api_key else ()
    return (("application", application), *auth)


class Client:
    def __init__(self, target: str, application: str = DEFAULT_APPLICATION,
                 timeout: float | None = None, api_key: str | None = None) -> None:
        self.channel = grpc.insecure_channel(target)
        self.stub = pb_grpc.GenerationStub(self.channel)
        self.metadata = call_metadata(application, api_key)
        self.timeout = timeout

    def generate(self, prompt: str | None = None, *, retry_refused_s: float = 0.0,
                 **kwargs: Any) -> Iterator[pb.GenerateResponse]:
        """Stream GenerateResponses; raises grpc.RpcError (e.g. INVALID_ARGUMENT). A request
        refused (RESOURCE_EXHAUSTED: the replicas are full) before its first response is retried
        with `backoff_s` for up to `retry_refused_s` seconds."""
        request = generate_request(prompt, **kwargs)
        give_up_at, attempt = time.monotonic() + retry_refused_s, 0
        while True:
            received = False
            try:
                for response in self.stub.Generate(request, metadata=self.metadata,
                                                   timeout=self.timeout):
                    received = True
                    yield response
                return
            except grpc.RpcError as err:
                attempt += 1
                wait = backoff_s(attempt)
                if received or err.code() != REFUSED or time.monotonic() + wait > give_up_at:
                    raise
            time.sleep(wait)

    def model_info(self) -> pb.ModelInfoResponse:
        return self.stub.ModelInfo(pb.ModelInfoRequest(), metadata=self.metadata)

    def tokenize(self, prompt: str) -> list[int]:
        reply = self.stub.Tokenize(pb.TokenizeRequest(prompt=prompt), metadata=self.metadata)
        return list(reply.token_ids)

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncClient:
    def __init__(self, target: str, application: str = DEFAULT_APPLICATION,
                 timeout: float | None = None, api_key: str | None = None) -> None:
        self.channel = grpc.aio.insecure_channel(target)
        self.stub = pb_grpc.GenerationStub(self.channel)
        self.metadata = call_metadata(application, api_key)
        self.timeout = timeout

    async def generate(
        self, prompt: str | None = None, **kwargs: Any
    ) -> AsyncIterator[pb.GenerateResponse]:
        request = generate_request(prompt, **kwargs)
        async for msg in self.stub.Generate(request, metadata=self.metadata, timeout=self.timeout):
            yield msg

    async def model_info(self) -> pb.ModelInfoResponse:
        return await self.stub.ModelInfo(pb.ModelInfoRequest(), metadata=self.metadata)

    async def close(self) -> None:
        await self.channel.close()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
