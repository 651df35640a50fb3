"""`build_app`: a validated config in, the Ray Serve application out.

Works with `serve run cluster.app:build_app model=...` and with a Serve config YAML whose
`import_path` is `cluster.app:build_app` and whose `args` are an AppConfig.

The engine settings are `workers.config.EngineConfig`'s: their defaults are read from it (one
definition each), and a config is checked by building an EngineConfig from it, so a bad value
fails here, naming the field, not later in every replica.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from ray.serve import Application

from cluster.deployment import GenerationDeployment
from cluster.router import request_router_config
from workers.config import DTYPES, EngineConfig, parse_size
from workers.model_executor.attention import BACKENDS
from workers.model_executor.attention.flash_backend import FLASH_BLOCK_MULTIPLE

GRPC_SERVICER_FUNCTIONS = ["cluster.grpc_ingress.add_generation_servicer"]
_ENGINE_DEFAULTS = {f.name: f.default for f in dataclasses.fields(EngineConfig)}


def _engine_default(name: str, **constraints: Any) -> Any:
    """A pydantic Field whose default is EngineConfig's `name`."""
    return Field(_ENGINE_DEFAULTS[name], **constraints)


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
    # Serve's health check of each replica (None: Serve's defaults, 10 s and 30 s); it fails
    # once the replica's engine step loop died, and Serve replaces the replica
    health_check_period_s: float | None = Field(None, gt=0)
    health_check_timeout_s: float | None = Field(None, gt=0)
    # the engine (workers.config.EngineConfig; defaults from there). auto: bfloat16 on CUDA,
    # float32 on CPU
    dtype: Literal[DTYPES] = _engine_default("dtype")  # type: ignore[valid-type]
    device: str = _engine_default("device")  # auto (cuda when present) | cpu | cuda | cuda:N
    # auto: flash_attn on CUDA when installed, else torch; cpu: kvserve's CPU kernels
    attention_backend: Literal[BACKENDS] = _engine_default("attention_backend")  # type: ignore[valid-type]
    # tokens per KV block; None: 16, or 256 with flash_attn (which needs a multiple of 256)
    block_size: int | None = _engine_default("block_size", ge=1)
    max_model_len: int | None = _engine_default("max_model_len", ge=1)  # None: the model's
    # with kv_cache_memory None, on CUDA: the fraction of device memory the replica may use
    gpu_memory_utilization: float = _engine_default("gpu_memory_utilization", gt=0, le=1)
    # RoPE override, transformers' rope_parameters keys (e.g. yarn context extension)
    rope_parameters: dict[str, Any] | None = _engine_default("rope_parameters")
    # bytes for each replica's KV pool (None: gpu_memory_utilization on CUDA, 2GiB on CPU);
    # set here, unlike the in-process engine, so CPU replicas sharing a machine fit
    kv_cache_memory: str | int | None = "1GiB"
    max_num_seqs: int = _engine_default("max_num_seqs", ge=1)
    max_num_batched_tokens: int = _engine_default("max_num_batched_tokens", ge=1)
    # each replica's admission queue; past it Generate answers RESOURCE_EXHAUSTED at once.
    # None: max_num_seqs (one batch waits; the excess is refused rather than left to time out)
    max_waiting_requests: int | None = _engine_default("max_waiting_requests", ge=1)
    # ...and by work: past this many KV pools' worth of waiting requests, RESOURCE_EXHAUSTED too
    max_waiting_kv_pools: float = _engine_default("max_waiting_kv_pools", gt=0)
    # ...and by time: past this expected time to first token (prompt work ahead plus its own,
    # at the replica's measured prompt throughput), RESOURCE_EXHAUSTED too (None: no bound)
    max_expected_wait_s: float | None = _engine_default("max_expected_wait_s", gt=0)
    # while requests decode, prompt chunks are sized so a step takes about this long: admitted
    # streams keep their inter-token latency while new prompts arrive (None: full budget steps).
    # Opt-in: chunk boundaries then depend on the load, and with them float rounding, so a
    # greedy answer at a near-tie can differ from the in-process engine's
    itl_target_ms: float | None = _engine_default("itl_target_ms", gt=0)
    # reuse KV blocks of equal prompt prefixes: on when serving (off in the in-process engine)
    enable_prefix_caching: bool = True
    # host memory per replica for the KV offload tier (demoted cached blocks, swapped requests)
    cpu_offload_memory: str | int = _engine_default("cpu_offload_memory")
    stream_coalesce_ms: float = Field(0.0, ge=0)  # >0: merge tokens made within it per message
    # the cache manager's Redis; None: $REDIS_URL, else an embedded redis-server
    redis_url: str | None = None
    kv_lease_ttl_s: float = Field(10.0, gt=0)  # a dead replica's index entries vanish within it
    kv_report_interval_ms: float = Field(50.0, gt=0)  # replicas batch KV events this long
    cache_aware_routing: bool = True  # route to the replica holding the longest cached prefix
    # ongoing requests by which a cache holder may exceed the least-loaded replica and still win
    routing_imbalance_threshold: float = Field(8.0, ge=0)

    @field_validator("device")
    @classmethod
    def _known_device(cls, device: str) -> str:
        if device != "auto":
            try:
                torch.device(device)
            except (RuntimeError, ValueError) as exc:
                raise ValueError(f"not a torch device: {device!r} (auto, cpu, cuda, cuda:N)"
                                 ) from exc
        return device

    @field_validator("kv_cache_memory", "cpu_offload_memory")
    @classmethod
    def _memory_size(cls, size: str | int | None) -> str | int | None:
        if size is not None:
            parse_size(size)  # ValueError: not a memory size
        return size

    @model_validator(mode="after")
    def _valid_engine_config(self) -> AppConfig:
        """What the engine would refuse at start, refused here (the message names the field)."""
        needs = {"flash_attn": "cuda", "cpu": "cpu"}.get(self.attention_backend)
        if needs and self.device != "auto" and torch.device(self.device).type != needs:
            raise ValueError(f"attention_backend {self.attention_backend} needs a {needs} "
                             f"device, not device {self.device!r}")
        if (self.attention_backend == "flash_attn" and self.block_size is not None
                and self.block_size % FLASH_BLOCK_MULTIPLE):
            raise ValueError(f"block_size {self.block_size}: flash_attn needs a multiple of "
                             f"{FLASH_BLOCK_MULTIPLE}")
        EngineConfig(**self.engine_config())  # its own checks (sizes, ranges)
        return self

    def engine_config(self) -> dict[str, Any]:
        """EngineConfig's keyword arguments, as every replica builds it."""
        return {"model": self.model, "dtype": self.dtype, "device": self.device,
                "attention_backend": self.attention_backend, "block_size": self.block_size,
                "max_model_len": self.max_model_len,
                "gpu_memory_utilization": self.gpu_memory_utilization,
                "rope_parameters": self.rope_parameters,
                "kv_cache_memory": self.kv_cache_memory,
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
    health = {k: v for k in ("health_check_period_s", "health_check_timeout_s")
              if (v := getattr(config, k)) is not None}
    if health:
        deployment = deployment.options(**health)
    if config.cache_aware_routing and config.enable_prefix_caching:
        deployment = deployment.options(request_router_config=request_router_config(
            config.model, imbalance_threshold=config.routing_imbalance_threshold))
    replicas = config.autoscaling.max_replicas if config.autoscaling else config.replicas
    return deployment.bind(config.engine_config(), replicas, config.stream_coalesce_ms,
                           config.cache_manager_config())
