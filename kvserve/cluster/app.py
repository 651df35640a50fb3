"""`build_app`: a validated config in, the Ray Serve application out.

Works with `serve run kvserve.cluster.app:build_app model=...` and with a Serve config YAML whose
`import_path` is `kvserve.cluster.app:build_app` and whose `args` are an AppConfig.

The engine section is generated from `kvserve.workers.config.EngineConfig`'s settings (one
definition
each: type, default, range, choices, help), with serving's own defaults named in
`kvserve.workers.config.ENTRY_POINT_DEFAULTS`; every engine setting can be set here and reaches
every
replica. A config is checked by building an EngineConfig from it, so a bad value fails here,
naming the field, not later in every replica.

Checking a config imports neither torch nor Ray: `kvserve deploy --replicas 0` answers in a
fraction of a second, not after the 5-7 s of those imports. `build_app` imports the deployment.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, create_model, field_validator, model_validator

from kvserve.cache_manager.index import LEASE_TTL_S, REPORT_INTERVAL_MS
from kvserve.workers.config import EngineConfig, engine_settings, entry_point_defaults, parse_size

if TYPE_CHECKING:
    from ray.serve import Application
    from ray.serve.config import RequestRouterConfig

GRPC_SERVICER_FUNCTIONS = ["kvserve.cluster.grpc_ingress.add_generation_servicer"]


def _engine_fields() -> dict[str, Any]:
    """AppConfig's engine section, generated from EngineConfig's settings: the same names,
    types, ranges and choices; the defaults EngineConfig's, but for the differences that
    kvserve.workers.config.ENTRY_POINT_DEFAULTS names for serving. Memory sizes stay as written
    (1GiB), checked by EngineConfig."""
    defaults = entry_point_defaults("serve")
    fields: dict[str, Any] = {}
    for spec in engine_settings():
        kind: Any = spec.type
        bounds = {"gt": spec.info.gt, "ge": spec.info.ge, "le": spec.info.le}
        if spec.info.choices:
            kind = Literal[spec.info.choices] | None if spec.optional else Literal[
                spec.info.choices]
        elif spec.info.memory:  # "1GiB" or bytes: parsed, then bounded, by EngineConfig
            kind, bounds = (str | int | None if spec.optional else str | int), {}
        fields[spec.name] = (kind, Field(defaults[spec.name], description=spec.info.help,
                                         **bounds))
    return fields


EngineSettings = create_model(
    "EngineSettings", __config__=ConfigDict(extra="forbid"), **_engine_fields())


class Autoscaling(BaseModel):
    model_config = ConfigDict(extra="forbid")

    min_replicas: int = Field(1, ge=0)
    max_replicas: int = Field(2, ge=1)
    # ongoing requests per replica Serve aims for: high, so continuous batching fills batches
    target_ongoing_requests: float = Field(32, gt=0)
    # how long load must stay above (below) target before Serve adds (removes) replicas, and
    # the window its average covers; Serve's defaults (a CPU test cluster shortens them)
    upscale_delay_s: float = Field(30.0, ge=0)
    downscale_delay_s: float = Field(600.0, ge=0)
    look_back_period_s: float = Field(30.0, gt=0)
    metrics_interval_s: float = Field(10.0, gt=0)


class AppConfig(EngineSettings):  # type: ignore[misc,valid-type]
    """The Serve application's config: every engine setting (EngineSettings, generated from
    EngineConfig) plus the deployment's own settings below."""

    model_config = ConfigDict(extra="forbid")

    replicas: int = Field(1, ge=1)  # fixed replica count, unless `autoscaling` is set
    autoscaling: Autoscaling | None = None
    max_ongoing_requests: int = Field(256, ge=1)  # enough to fill continuous batches
    # Serve's queue in front of the replicas; past it the proxy answers RESOURCE_EXHAUSTED
    max_queued_requests: int = Field(-1, ge=-1)  # -1: unbounded
    # on shutdown Serve waits this long for running streams, then ends them UNAVAILABLE
    graceful_shutdown_timeout_s: float = Field(20.0, ge=0)
    # how often a stopping replica checks that its streams have ended. Serve sleeps this long
    # before the first check, so with its default (2 s) every replica stop (a rollout, a
    # scale-in, `kvserve down`) took at least 2 s even when idle; 0.5 s is still far longer
    # than a proxy takes to hear that the replica is stopping and route elsewhere
    graceful_shutdown_wait_loop_s: float = Field(0.5, gt=0)
    num_cpus_per_replica: float = Field(1.0, gt=0)
    num_gpus_per_replica: float = Field(0.0, ge=0)  # 1 on GPU nodes
    # Serve's health check of each replica (None: Serve's defaults, 10 s and 30 s); it fails
    # once the replica's engine step loop died, and Serve replaces the replica
    health_check_period_s: float | None = Field(None, gt=0)
    health_check_timeout_s: float | None = Field(None, gt=0)
    stream_coalesce_ms: float = Field(0.0, ge=0)  # >0: merge tokens made within it per message
    # the cache manager's Redis; None: $REDIS_URL, else an embedded redis-server
    redis_url: str | None = None
    # a dead replica's index entries vanish within it
    kv_lease_ttl_s: float = Field(LEASE_TTL_S, gt=0)
    kv_report_interval_ms: float = Field(REPORT_INTERVAL_MS, gt=0)  # replicas batch KV events
    # API keys (kvserve/cluster/auth.py: `keys_file_format`), besides $KVSERVE_API_KEYS in the
    # replicas'
    # environment; none: the service is open. A path, so the keys never enter the app config
    api_keys_file: str | None = None
    # OpenTelemetry request spans to this OTLP/gRPC receiver (host:port), as vLLM's
    # --otlp-traces-endpoint; None: no tracing
    otlp_traces_endpoint: str | None = None
    cache_aware_routing: bool = True  # route to the replica holding the longest cached prefix
    # ongoing requests by which a cache holder may exceed the least-loaded replica and still win
    routing_imbalance_threshold: float = Field(8.0, ge=0)

    @field_validator("device")
    @classmethod
    def _known_device(cls, device: str) -> str:
        if device != "auto":
            import torch  # (only for a device named: see the module docstring)

            try:
                torch.device(device)
            except (RuntimeError, ValueError) as exc:
                raise ValueError(f"not a torch device: {device!r} (auto, cpu, cuda, cuda:N)"
                                 ) from exc
        return device

    @field_validator("api_keys_file")
    @classmethod
    def _readable_keys(cls, path: str | None) -> str | None:
        """Read now, so a bad file fails `kvserve up` naming the field, not every replica;
        made absolute, since replicas run in other directories."""
        if path is None:
            return None
        from kvserve.cluster.auth import load_key_ring

        resolved = os.path.abspath(os.path.expanduser(path))
        try:
            load_key_ring(keys_file=resolved, env={})
        except (OSError, ValueError) as exc:
            raise ValueError(f"{path}: {exc}") from None
        return resolved

    @field_validator(*(s.name for s in engine_settings() if s.info.memory))
    @classmethod
    def _memory_size(cls, size: str | int | None) -> str | int | None:
        if size is not None:
            parse_size(size)  # ValueError: not a memory size (pydantic names the field)
        return size

    @model_validator(mode="after")
    def _valid_engine_config(self) -> AppConfig:
        """What the engine would refuse at start, refused here (the message names the field)."""
        needs = {"flash_attn": "cuda", "cpu": "cpu"}.get(self.attention_backend)
        if needs and self.device != "auto" and self.device.split(":")[0] != needs:
            raise ValueError(f"attention_backend {self.attention_backend} needs a {needs} "
                             f"device, not device {self.device!r}")
        if self.attention_backend == "flash_attn" and self.block_size is not None:
            from kvserve.workers.model_executor.attention.flash_backend import FLASH_BLOCK_MULTIPLE

            if self.block_size % FLASH_BLOCK_MULTIPLE:
                raise ValueError(f"block_size {self.block_size}: flash_attn needs a multiple "
                                 f"of {FLASH_BLOCK_MULTIPLE}")
        EngineConfig(**self.engine_config())  # its own checks (sizes, ranges)
        return self

    def engine_config(self) -> dict[str, Any]:
        """EngineConfig's keyword arguments, every setting, as every replica builds it."""
        return {spec.name: getattr(self, spec.name) for spec in engine_settings()}

    def cache_manager_config(self) -> dict[str, Any]:
        return {"redis_url": self.redis_url or os.environ.get("REDIS_URL"),
                "lease_ttl_s": self.kv_lease_ttl_s,
                "report_interval_ms": self.kv_report_interval_ms}


def routing(config: AppConfig) -> RequestRouterConfig | None:
    """The cache-aware router's config (None: Serve's own routing). It is told what a replica
    admits (`max_num_seqs` running + `max_waiting_requests` waiting), so that it never sends a
    request to a full holder to be refused while another replica has room."""
    if not (config.cache_aware_routing and config.enable_prefix_caching):
        return None
    from kvserve.cluster.router import request_router_config

    engine = EngineConfig(**config.engine_config())  # its defaults filled in
    return request_router_config(
        config.model, imbalance_threshold=config.routing_imbalance_threshold,
        replica_capacity=engine.max_num_seqs + engine.max_waiting_requests)


def build_app(args: dict[str, Any] | AppConfig) -> Application:
    from kvserve.cluster.deployment import GenerationDeployment

    config = args if isinstance(args, AppConfig) else AppConfig.model_validate(args)
    scaling: dict[str, Any] = {"num_replicas": config.replicas}
    actor_options: dict[str, Any] = {"num_cpus": config.num_cpus_per_replica,
                                     "num_gpus": config.num_gpus_per_replica}
    if config.autoscaling is not None:
        scaling = {"num_replicas": "auto", "autoscaling_config": config.autoscaling.model_dump()}
    if config.tensor_parallel_size > 1:  # a placement group per replica, a bundle per rank
        from kvserve.cluster.tp_ranks import bundles

        scaling |= {"placement_group_bundles": bundles(
            config.tensor_parallel_size, config.num_cpus_per_replica,
            config.num_gpus_per_replica), "placement_group_strategy": "STRICT_PACK"}
    deployment = GenerationDeployment.options(
        **scaling,
        max_ongoing_requests=config.max_ongoing_requests,
        max_queued_requests=config.max_queued_requests,
        graceful_shutdown_timeout_s=config.graceful_shutdown_timeout_s,
        graceful_shutdown_wait_loop_s=config.graceful_shutdown_wait_loop_s,
        ray_actor_options=actor_options,
    )
    health = {k: v for k in ("health_check_period_s", "health_check_timeout_s")
              if (v := getattr(config, k)) is not None}
    if health:
        deployment = deployment.options(**health)
    if (router := routing(config)) is not None:
        deployment = deployment.options(request_router_config=router)
    replicas = config.autoscaling.max_replicas if config.autoscaling else config.replicas
    return deployment.bind(config.engine_config(), replicas, config.stream_coalesce_ms,
                           config.cache_manager_config(), config.api_keys_file,
                           config.otlp_traces_endpoint)
