"""The Ray Serve deployment: each replica owns one engine and serves the Generation RPCs.

Ray Serve's gRPC proxy calls the methods named after the RPCs with the request message and a
`grpc_context`; `Generate` is an async generator, so tokens stream as they are produced. Serve's
HTTP proxy sends HTTP requests to the OpenAI-compatible FastAPI app each replica builds over
its own engine (`kvserve.cluster.openai`): the same replicas, no extra hop. Either way, a client
that
disconnects cancels the replica's task, which aborts the engine request and frees its KV
blocks (AsyncLLMEngine.generate's cleanup).

A replica reports ready only after a warm-up request went through its whole path on its device
(a replica that cannot generate fails to start, and Serve retries it), and its `check_health`
fails once the engine's step loop has died, so Serve replaces it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import time
from collections.abc import AsyncIterator
from typing import Any

import torch
from ray import serve
from ray.serve.grpc_util import RayServegRPCContext

from kvserve.cache_manager import actor as cache_manager
from kvserve.cache_manager.index import LEASE_TTL_S, REPORT_INTERVAL_MS
from kvserve.cache_manager.manager import ReplicaState
from kvserve.cluster import key_rings, ray_compat, tenant_limits
from kvserve.cluster.auth import OPEN_GATE, Gate, Tenant, load_key_ring
from kvserve.cluster.convert import status_code
from kvserve.cluster.kv_reporter import KVReporter
from kvserve.cluster.local_head import LOGICAL_GPUS_ENV
from kvserve.cluster.metrics import ServiceMetrics
from kvserve.cluster.openai.http import build_openai_app
from kvserve.cluster.openai.serving import OpenAIServing
from kvserve.cluster.replica_status import StatusPublisher, placement
from kvserve.cluster.service import GenerationService
from kvserve.cluster.tracing import RequestTracer, trace_context
from kvserve.v1 import generation_pb2 as pb
from kvserve.workers.async_engine import AsyncLLMEngine, WarmUp
from kvserve.workers.config import EngineConfig, parse_size
from kvserve.workers.core.outputs import RequestOutput
from kvserve.workers.engine import LLMEngine

logger = logging.getLogger("ray.serve")

SHUTDOWN_DRAIN_S = 2.0
# "1" in a replica's environment enables `admin` (fault injection). Tests set it before they
# start Ray; a production replica refuses every admin call.
ADMIN_ENV = "KVSERVE_REPLICA_ADMIN"


@serve.deployment(name="Generation")
@serve.ingress()  # HTTP: the app `__serve_build_asgi_app__` builds over this replica's engine
class GenerationDeployment:
    async def __init__(  # type: ignore[misc] - Serve awaits an async constructor
        self, engine_config: dict[str, Any], replicas: int, stream_coalesce_ms: float = 0.0,
        cache_manager_config: dict | None = None, api_keys_file: str | None = None,
        otlp_traces_endpoint: str | None = None,
    ) -> None:
        """Async so that the warm-up runs on the engine's own step loop, as requests do."""
        engine_config, self.substituted = on_logical_gpus(
            engine_config, placement()[1], torch.cuda.is_available(),
            os.environ.get(LOGICAL_GPUS_ENV) == "1")
        config = EngineConfig(**engine_config)
        self.engine = LLMEngine(config, rank_launcher=_rank_launcher(config))
        self.async_engine = AsyncLLMEngine(self.engine)
        # before anything reports on the engine: metrics and the cache manager never see it
        self.warm_up = await _warm_up(self.async_engine)
        self.metrics = ServiceMetrics(self.engine.info.name)
        # what reached this replica: gRPC Generate calls, HTTP requests, engine requests
        self.counts = {"generate_calls": 0, "http_requests": 0, "engine_requests": 0}
        self.gate, self.limiter = await _start_gate(api_keys_file)
        self.tracer = RequestTracer(otlp_traces_endpoint) if otlp_traces_endpoint else None
        self.service = GenerationService(self.async_engine, replicas=replicas,
                                         stream_coalesce_ms=stream_coalesce_ms,
                                         observe=self._observe, tracer=self.tracer)
        self.openai = OpenAIServing(self.async_engine, observe=self._observe,
                                    replicas=replicas, on_usage=self._used,
                                    tracer=self.tracer)
        self.status_publisher = StatusPublisher(self.engine.load, device=self.engine.info.device,
                                                rank_pids=self.engine.rank_pids()).start()
        _say_if_a_gpu_is_only_logical(self.status_publisher.gpu_ids, self.engine.info.device,
                                      self.substituted)
        self.kv_reporter = _start_kv_reporter(self.engine, self.status_publisher.replica_id,
                                              cache_manager_config or {})
        self.open_streams = 0

    def _observe(self, stream: AsyncIterator[RequestOutput]) -> AsyncIterator[RequestOutput]:
        self.counts["engine_requests"] += 1
        return self.metrics.track(stream, self.engine)

    def _used(self, tenant: str, tokens: int) -> None:
        """A tenant's request computed `tokens`: its tokens_per_min budget (fire and forget)."""
        if self.limiter is not None:
            self.limiter.record.remote(tenant, tokens)

    def _grpc_tenant(self, grpc_context: RayServegRPCContext) -> Tenant | None:
        """The gRPC caller's tenant: the proxy checked the key already (and its limits); this is
        the backstop for a proxy without kvserve's guard, and gives the tenant's usage a name."""
        metadata = dict(grpc_context.invocation_metadata())
        return self.gate.tenant(metadata.get("authorization"))

    def __serve_build_asgi_app__(self) -> Any:
        """Serve's HTTP proxy sends this replica's HTTP requests to this app (OpenAI's API),
        behind the same keys and tenant limits as gRPC."""
        return _Counted(build_openai_app(self.openai, gate=self.gate), self.counts)

    async def check_health(self) -> None:
        """Serve's health check, every `health_check_period_s`: raising marks the replica
        unhealthy, and Serve replaces it after a few failures in a row. It fails once the
        engine's step loop died (a step raised, e.g. on a CUDA fault): such a replica would
        answer every request with an error (EngineDeadError, UNAVAILABLE) until replaced."""
        self.async_engine.check_health()

    async def Generate(  # noqa: N802 - named after the RPC
        self, request: pb.GenerateRequest, grpc_context: RayServegRPCContext
    ) -> AsyncIterator[pb.GenerateResponse]:
        self.open_streams += 1
        self.counts["generate_calls"] += 1
        try:
            tenant = self._grpc_tenant(grpc_context)
            if tenant is not None and not request.cache_salt:
                request.cache_salt = tenant.name
            metadata = dict(grpc_context.invocation_metadata())
            async for msg in self.service.Generate(request, trace_context(metadata)):
                if tenant is not None and msg.HasField("usage"):
                    self._used(tenant.name, msg.usage.prompt_tokens + msg.usage.completion_tokens)
                yield msg
        except Exception as exc:
            _set_status(grpc_context, exc)
            raise
        finally:
            self.open_streams -= 1

    async def ModelInfo(  # noqa: N802
        self, request: pb.ModelInfoRequest, grpc_context: RayServegRPCContext
    ) -> pb.ModelInfoResponse:
        try:
            self._grpc_tenant(grpc_context)
        except Exception as exc:
            _set_status(grpc_context, exc)
            raise
        return await self.service.ModelInfo(request)

    async def Tokenize(  # noqa: N802
        self, request: pb.TokenizeRequest, grpc_context: RayServegRPCContext
    ) -> pb.TokenizeResponse:
        try:
            self._grpc_tenant(grpc_context)
            return await self.service.Tokenize(request)
        except Exception as exc:
            _set_status(grpc_context, exc)
            raise

    async def __del__(self) -> None:
        """Serve's shutdown hook, after its graceful wait: streams still open end UNAVAILABLE
        (EngineShutdownError), new ones are refused the same way, and every KV block is freed."""
        if not hasattr(self, "kv_reporter"):  # the constructor failed part way
            if hasattr(self, "async_engine"):
                await self.async_engine.shutdown()
            elif hasattr(self, "engine"):
                self.engine.shutdown()
            if hasattr(self, "status_publisher"):
                self.status_publisher.stop()
            return
        self.status_publisher.stop()
        self.kv_reporter.stop()
        await self.async_engine.shutdown()
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

    def request_counts(self) -> dict[str, int]:
        """gRPC Generate calls and HTTP requests that reached this replica, and engine requests
        it opened (either protocol): a call refused at a proxy counts in none of them."""
        return dict(self.counts)

    def kv_stats(self) -> dict:
        return dataclasses.asdict(self.engine.kv_stats())

    def recent_steps(self) -> dict:
        """What `kvserve trace --deployment` draws for this replica: its engine's recorded
        steps and the timelines of its last ended requests (StepRecord / RequestTimeline
        objects), with the clock offset that turns their times into Unix time."""
        return {"replica_id": self.status_publisher.replica_id,
                "wall_offset": self.engine.wall_offset, "steps": self.engine.recent_steps(),
                "timelines": self.engine.recent_timelines()}

    def warm_up_report(self) -> dict:
        """The warm-up request this replica ran before it took traffic (prompt_tokens,
        generated_tokens, seconds); also in the replica's log."""
        return dataclasses.asdict(self.warm_up)

    def admin(self, action: str) -> str:
        """Fault injection on this one replica, to test what Serve does with a broken one;
        refused unless $KVSERVE_REPLICA_ADMIN is "1" in the replica's environment. Not a gRPC
        method: only a DeploymentHandle inside the cluster reaches it.

        `fail_next_step`: the next model step raises, as a CUDA fault would, so the engine's
        step loop dies (the request it ran fails UNAVAILABLE) and `check_health` fails.
        `fail_rank_step` (tensor_parallel_size > 1): the next step's forward raises inside
        tensor-parallel rank 1 instead, which ends that rank and then the same way.
        Returns this replica's id."""
        if os.environ.get(ADMIN_ENV) != "1":
            raise PermissionError(f"admin actions are off on this replica (set {ADMIN_ENV}=1 "
                                  "in its environment to allow them)")
        if action == "fail_rank_step" and self.engine.followers is not None:
            _fail_rank_step(self.engine.followers)
            return self.status_publisher.replica_id
        if action != "fail_next_step":
            raise ValueError(f"unknown admin action {action!r} (fail_next_step, "
                             "fail_rank_step with tensor_parallel_size > 1)")

        def failing_step() -> list:
            raise RuntimeError("injected step failure (admin fail_next_step)")

        self.engine.step = failing_step  # type: ignore[method-assign]
        return self.status_publisher.replica_id


def _rank_launcher(config: EngineConfig) -> Any:
    """Tensor-parallel ranks 1..N-1 as Ray actors in this replica's placement group (one
    bundle each, as `build_app` reserved them); None without tp."""
    if config.tensor_parallel_size == 1:
        return None
    from kvserve.cluster import tp_ranks

    return tp_ranks.launcher()


def _fail_rank_step(followers: Any) -> None:
    """The next step sent to rank 1 writes its K/V to slots outside the pool: its forward
    raises there (an IndexError), its process ends, and rank 0's collective fails."""
    send = followers.send_step

    def corrupt(plan: Any) -> None:
        followers.send_step = send
        send(dataclasses.replace(plan, slots=[1 << 40] * len(plan.slots)))

    followers.send_step = corrupt


class _Counted:
    """The replica's ASGI app, counting the HTTP requests that reach it."""

    def __init__(self, app: Any, counts: dict[str, int]) -> None:
        self.app, self.counts = app, counts

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            self.counts["http_requests"] += 1
        await self.app(scope, receive, send)


async def _start_gate(api_keys_file: str | None) -> tuple[Gate, Any]:
    """This application's keys (the file, and $KVSERVE_API_KEYS in the replica's environment),
    published for the gRPC proxy; and its limiter actor when a tenant has limits."""
    ring = load_key_ring(keys_file=api_keys_file)
    app = serve.get_replica_context().app_name
    key_rings.publish(app, ring)
    if ring.open:
        return OPEN_GATE, None
    if not ring.limited:
        return Gate(ring), None
    actor = tenant_limits.limiter(app)
    await actor.configure.remote(ring.tenants)

    async def admit(tenant: str) -> Any:
        return await actor.admit.remote(tenant)

    logger.info("kvserve: %d API key(s), %d tenant(s)", len(ring.digests), len(ring.tenants))
    return Gate(ring, admit), actor


async def _warm_up(engine: AsyncLLMEngine) -> WarmUp:
    """The engine's warm-up request, or the replica fails to start with a message that says
    so (Serve retries the constructor, then reports the deployment failed)."""
    try:
        result = await engine.warm_up()
    except Exception as exc:
        await engine.shutdown()
        raise RuntimeError(f"kvserve: the replica's warm-up request failed, so it does not "
                           f"start: {type(exc).__name__}: {exc}") from exc
    logger.info("kvserve: warm-up: %d prompt tokens, %d generated, in %.2f s",
                result.prompt_tokens, result.generated_tokens, result.seconds)
    return result


# the host KV tier a GPU config gets on a logical GPU: its own size (16 GiB in gpu.yaml) is
# meant for a GPU node's RAM, and on the CPU the tier is allocated (zeroed) at start
LOGICAL_GPU_HOST_TIER = 512 * 1024**2


def on_logical_gpus(config: dict[str, Any], gpu_ids: list[Any], cuda: bool,
                    logical: bool) -> tuple[dict[str, Any], dict[str, tuple[Any, Any]]]:
    """The engine config a replica runs, and what was changed (setting -> (asked, used)).

    A GPU config (device cuda, a CUDA-only attention backend, infra/serve/gpu.yaml's 16 GiB
    host tier) on a node whose GPUs kvserve declared itself (`kvserve up --gpus-per-node`,
    LOGICAL_GPUS_ENV) and where CUDA is absent runs on the CPU: a multi-node GPU deployment,
    simulated on one machine, with everything above the device as on GPUs. Anywhere else a
    config asking for CUDA without it fails at start, loudly, as it should on a real GPU node."""
    if not (gpu_ids and logical and not cuda):
        return config, {}
    used = dict(config)
    if str(config.get("device", "auto")).startswith("cuda"):
        used["device"] = "cpu"
    if config.get("attention_backend") in ("flash_attn", "triton"):  # CUDA kernels
        used["attention_backend"] = "auto"
    if parse_size(config.get("cpu_offload_memory") or 0) > LOGICAL_GPU_HOST_TIER:
        used["cpu_offload_memory"] = LOGICAL_GPU_HOST_TIER
    return used, {k: (config[k], used[k]) for k in used if used[k] != config.get(k)}


def _say_if_a_gpu_is_only_logical(gpu_ids: list[str], device: str,
                                  substituted: dict[str, tuple[Any, Any]]) -> None:
    """Ray gave this replica a GPU (num_gpus_per_replica) that has no CUDA device behind it:
    a simulated node (`kvserve up --local-nodes N --gpus-per-node G`) or a broken driver. Say
    so once, in the replica's log, with what a GPU config had to give up (on_logical_gpus);
    the engine runs on the CPU."""
    if gpu_ids and not device.startswith("cuda"):
        changes = "".join(f"; {k} {asked} -> {used}" for k, (asked, used) in substituted.items())
        logger.warning("kvserve: Ray assigned GPU %s to this replica, but no CUDA device is "
                       "visible: a logical GPU only; the engine runs on %s%s",
                       ",".join(gpu_ids), device, changes)


def _start_kv_reporter(engine: LLMEngine, replica_id: str, config: dict) -> KVReporter:
    """Report to this deployment's cache manager (started by the first replica)."""
    context = serve.get_replica_context()
    key = cache_manager.deployment_key(context.app_name, context.deployment)
    manager = cache_manager.get_or_start(key, config.get("redis_url"),
                                         config.get("lease_ttl_s", LEASE_TTL_S),
                                         resources=ray_compat.head_node_pin())
    interval_s = config.get("report_interval_ms", REPORT_INTERVAL_MS) / 1000
    return KVReporter(engine, manager, replica_id, interval_s=interval_s).start()


def _set_status(grpc_context: RayServegRPCContext, exc: Exception) -> None:
    """The proxy sends a status the replica set before raising (not INTERNAL)."""
    grpc_context.set_code(status_code(exc))
    grpc_context.set_details(str(exc))
