"""The Ray Serve deployment: each replica owns one engine and serves the Generation RPCs.

Ray Serve's gRPC proxy calls the methods named after the RPCs with the request message and a
`grpc_context`; `Generate` is an async generator, so tokens stream as they are produced. A
client that disconnects cancels the replica's task, which aborts the engine request and frees
its KV blocks (AsyncLLMEngine.generate's cleanup).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

from ray import serve
from ray.serve.grpc_util import RayServegRPCContext

from cluster.convert import status_code
from cluster.metrics import ServiceMetrics
from cluster.replica_status import StatusPublisher
from cluster.service import GenerationService
from kvserve.v1 import generation_pb2 as pb
from workers.async_engine import AsyncLLMEngine
from workers.config import EngineConfig
from workers.engine import LLMEngine

SHUTDOWN_DRAIN_S = 2.0


@serve.deployment(name="Generation")
class GenerationDeployment:
    def __init__(self, engine_config: dict[str, Any], replicas: int,
                 stream_coalesce_ms: float = 0.0) -> None:
        self.engine = LLMEngine(EngineConfig(**engine_config))
        self.service = GenerationService(AsyncLLMEngine(self.engine), replicas=replicas,
                                         stream_coalesce_ms=stream_coalesce_ms)
        self.metrics = ServiceMetrics(self.engine.info.name)
        self.status_publisher = StatusPublisher(self.engine.load).start()
        self.open_streams = 0

    async def Generate(  # noqa: N802 - named after the RPC
        self, request: pb.GenerateRequest, grpc_context: RayServegRPCContext
    ) -> AsyncIterator[pb.GenerateResponse]:
        self.open_streams += 1
        try:
            async for msg in self.metrics.track(self.service.Generate(request), self.engine):
                yield msg
        except Exception as exc:
            _set_status(grpc_context, exc)
            raise
        finally:
            self.open_streams -= 1

    async def ModelInfo(  # noqa: N802
        self, request: pb.ModelInfoRequest, grpc_context: RayServegRPCContext
    ) -> pb.ModelInfoResponse:
        return await self.service.ModelInfo(request)

    async def Tokenize(  # noqa: N802
        self, request: pb.TokenizeRequest, grpc_context: RayServegRPCContext
    ) -> pb.TokenizeResponse:
        try:
            return await self.service.Tokenize(request)
        except Exception as exc:
            _set_status(grpc_context, exc)
            raise

    async def __del__(self) -> None:
        """Serve's shutdown hook, after its graceful wait: streams still open end UNAVAILABLE
        (EngineShutdownError), new ones are refused the same way, and every KV block is freed."""
        self.status_publisher.stop()
        await self.service.engine.shutdown()
        deadline = time.monotonic() + SHUTDOWN_DRAIN_S  # Serve kills the actor when we return:
        while self.open_streams and time.monotonic() < deadline:  # let the errors leave first
            await asyncio.sleep(0.02)
        await asyncio.sleep(0.2)  # the last status still crossing to the proxy

    def kv_cache_usage(self) -> float:
        return self.engine.kv_cache_usage()

    def status(self) -> dict:
        """This replica's row (replica_id, pid, node_ip, running, waiting, kv_cache_usage,
        updated_at), as `kvserve status` shows it."""
        return self.status_publisher.current().to_dict()


def _set_status(grpc_context: RayServegRPCContext, exc: Exception) -> None:
    """The proxy sends a status the replica set before raising (not INTERNAL)."""
    grpc_context.set_code(status_code(exc))
    grpc_context.set_details(str(exc))
