"""`build_app`: a validated config in, the Ray Serve application out.

Works with `serve run cluster.app:build_app model=...` and with a Serve config YAML whose
`import_path` is `cluster.app:build_app` and whose `args` are an AppConfig.
"""

from __future__ import annotations

import os
from typing import Any

from pydantic import BaseModel, ConfigDict, Field
from ray.serve import Application

from cluster.deployment import GenerationDeployment
from cluster.router import request_router_config

GRPC_SERVICER_FUNCTIONS = ["cluster.grpc_ingress.add_generation_servicer"]


class Autoscaling(BaseModel):
    model_config = ConfigDict(extra="forbid")

    min_replicas: int = Field(1, ge=0)
    max_replicas: int = Field(2, ge=1)
    # ongoing requests per replica Serve aims for: high, so continuous batching fills batches
    target_ongoing_requests: float = Field(32, gt=0)


class AppConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str | None = None  # None: SmolLM2-135M-Instruct
    replicas: int = Field(1, ge=1)  # fixed replica count, unless `autoscaling` is set
    autoscaling: Autoscaling | None = None
    max_ongoing_requests: int = Field(256, ge=1)  # enough to fill continuous batches
    # Serve's queue in front of the replicas; past it the proxy answers RESOURCE_EXHAUSTED
    max_queued_requests: int = Field(-1, ge=-1)  # -1: unbounded
    # on shutdown Serve waits this long for running streams, then ends them UNAVAILABLE
    graceful_shutdown_timeout_s: float = Field(20.0, ge=0)
    num_cpus_per_replica: float = Field(1.0, gt=0)
    num_gpus_per_replica: float = Field(0.0, ge=0)  # 1 on GPU nodes
    kv_cache_memory: str | int | None = "1GiB"
    max_num_seqs: int = Field(64, ge=1)
    max_num_batched_tokens: int = Field(512, ge=1)
    # each replica's admission queue; past it Generate answers RESOURCE_EXHAUSTED at once.
    # None: max_num_seqs (one batch waits; the excess is refused rather than left to time out)
    max_waiting_requests: int | None = Field(None, ge=1)
    # ...and by work: past this many KV pools' worth of waiting requests, RESOURCE_EXHAUSTED too
    max_waiting_kv_pools: float = Field(4.0, gt=0)
    # ...and by time: past this expected time to first token (prompt work ahead plus its own,
    # at the replica's measured prompt throughput), RESOURCE_EXHAUSTED too (None: no bound)
    max_expected_wait_s: float | None = Field(30.0, gt=0)
    # while requests decode, prompt chunks are sized so a step takes about this long: admitted
    # streams keep their inter-token latency while new prompts arrive (None: full budget steps).
    # Opt-in: chunk boundaries then depend on the load, and with them float rounding, so a
    # greedy answer at a near-tie can differ from the in-process engine's
    itl_target_ms: float | None = Field(None, gt=0)
    enable_prefix_caching: bool = True  # reuse KV blocks of equal prompt prefixes
    # host memory per replica for the KV offload tier (demoted cached blocks, swapped requests)
    cpu_offload_memory: str | int = 0
    stream_coalesce_ms: float = Field(0.0, ge=0)  # >0: merge tokens made within it per message
    # the cache manager's Redis; None: $REDIS_URL, else an embedded redis-server
    redis_url: str | None = None
    kv_lease_ttl_s: float = Field(10.0, gt=0)  # a dead replica's index entries vanish within it
    kv_report_interval_ms: float = Field(50.0, gt=0)  # replicas batch KV events this long
    cache_aware_routing: bool = True  # route to the replica holding the longest cached prefix
    # ongoing requests by which a cache holder may exceed the least-loaded replica and still win
    routing_imbalance_threshold: float = Field(8.0, ge=0)

    def engine_config(self) -> dict[str, Any]:
        return {"model": self.model, "kv_cache_memory": self.kv_cache_memory,
                "max_num_seqs": self.max_num_seqs,
                "max_num_batched_tokens": self.max_num_batched_tokens,
                "max_waiting_requests": self.max_waiting_requests,
                "max_waiting_kv_pools": self.max_waiting_kv_pools,
                "max_expected_wait_s": self.max_expected_wait_s,
                "itl_target_ms": self.itl_target_ms,
                "enable_prefix_caching": self.enable_prefix_caching,
                "cpu_offload_memory": self.cpu_offload_memory}

    def cache_manager_config(self) -> dict[str, Any]:
        return {"redis_url": self.redis_url or os.environ.get("REDIS_URL"),
                "lease_ttl_s": self.kv_lease_ttl_s,
                "report_interval_ms": self.kv_report_interval_ms}


def build_app(args: dict[str, Any] | AppConfig) -> Application:
    config = args if isinstance(args, AppConfig) else AppConfig.model_validate(args)
    scaling: dict[str, Any] = {"num_replicas": config.replicas}
    actor_options: dict[str, Any] = {"num_cpus": config.num_cpus_per_replica,
                                     "num_gpus": config.num_gpus_per_replica}
    if config.autoscaling is not None:
        scaling = {"num_replicas": "auto", "autoscaling_config": config.autoscaling.model_dump()}
    deployment = GenerationDeployment.options(
        **scaling,
        max_ongoing_requests=config.max_ongoing_requests,
        max_queued_requests=config.max_queued_requests,
        graceful_shutdown_timeout_s=config.graceful_shutdown_timeout_s,
        ray_actor_options=actor_options,
    )
    if config.cache_aware_routing and config.enable_prefix_caching:
        deployment = deployment.options(request_router_config=request_router_config(
            config.model, imbalance_threshold=config.routing_imbalance_threshold))
    replicas = config.autoscaling.max_replicas if config.autoscaling else config.replicas
    return deployment.bind(config.engine_config(), replicas, config.stream_coalesce_ms,
                           config.cache_manager_config())
