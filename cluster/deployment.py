"""The Ray Serve deployment: each replica owns one engine and serves the Generation RPCs.

Ray Serve's gRPC proxy calls the methods named after the RPCs with the request message and a
`grpc_context`; `Generate` is an async generator, so tokens stream as they are produced. A
client that disconnects cancels the replica's task, which aborts the engine request and frees
its KV blocks (AsyncLLMEngine.generate's cleanup).
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import AsyncIterator
from typing import Any

from ray import serve
from ray.serve.grpc_util import RayServegRPCContext

from cache_manager import actor as cache_manager
from cache_manager.manager import ReplicaState
from cluster.convert import status_code
from cluster.kv_reporter import KVReporter
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
                 stream_coalesce_ms: float = 0.0, cache_manager_config: dict | None = None) -> None:
        self.engine = LLMEngine(EngineConfig(**engine_config))
        self.service = GenerationService(AsyncLLMEngine(self.engine), replicas=replicas,
                                         stream_coalesce_ms=stream_coalesce_ms)
        self.metrics = ServiceMetrics(self.engine.info.name)
        self.status_publisher = StatusPublisher(self.engine.load).start()
        self.kv_reporter = _start_kv_reporter(self.engine, self.status_publisher.replica_id,
                                              cache_manager_config or {})
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
        self.kv_reporter.stop()
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

    def kv_state(self) -> ReplicaState:
        """Send pending KV events to the cache manager, then say what this replica holds
        (`kvserve cache check` compares the two)."""
        self.kv_reporter.send_once(force=True)
        return self.kv_reporter.state()

    def kv_stats(self) -> dict:
        return dataclasses.asdict(self.engine.kv_stats())


def _start_kv_reporter(engine: LLMEngine, replica_id: str, config: dict) -> KVReporter:
    """Report to this deployment's cache manager (started by the first replica)."""
    context = serve.get_replica_context()
    key = cache_manager.deployment_key(context.app_name, context.deployment)
    manager = cache_manager.get_or_start(key, config.get("redis_url"),
                                         config.get("lease_ttl_s", 10.0))
    return KVReporter(engine, manager, replica_id,
                      interval_s=config.get("report_interval_ms", 50) / 1000).start()


def _set_status(grpc_context: RayServegRPCContext, exc: Exception) -> None:
    """The proxy sends a status the replica set before raising (not INTERNAL)."""
    grpc_context.set_code(status_code(exc))
    grpc_context.set_details(str(exc))
