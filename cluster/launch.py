"""`kvserve up`: start (or join) Ray, deploy the app behind Ray Serve's gRPC proxy, serve until
Ctrl-C, then shut down cleanly."""

from __future__ import annotations

import os
import signal
import threading
from pathlib import Path
from typing import Any

from cache_manager import actor as cache_manager
from cluster.app import GRPC_SERVICER_FUNCTIONS, AppConfig, build_app

APP_NAME = "kvserve"


def load_config(path: str | None, overrides: dict[str, Any]) -> AppConfig:
    values: dict[str, Any] = {}
    if path:
        import yaml

        values = yaml.safe_load(Path(path).read_text()) or {}
        if "applications" in values:  # a Serve config (infra/serve/*.yaml): its app's args
            values = values["applications"][0].get("args") or {}
    values |= {k: v for k, v in overrides.items() if v is not None}
    return AppConfig.model_validate(values)


def serve_until_interrupted(config_path: str | None, overrides: dict[str, Any],
                            grpc_port: int) -> int:
    import ray
    from ray import serve
    from ray.serve.config import gRPCOptions

    config = load_config(config_path, overrides)
    context = ray.init(address=os.environ.get("RAY_ADDRESS"), log_to_driver=False)
    serve.start(grpc_options=gRPCOptions(port=grpc_port,
                                         grpc_servicer_functions=GRPC_SERVICER_FUNCTIONS))
    serve.run(build_app(config), name=APP_NAME)
    print(f"kvserve: serving {config.model or 'SmolLM2-135M-Instruct'} with "
          f"{config.replicas} replica(s)", flush=True)
    print(f"kvserve: gRPC at 127.0.0.1:{grpc_port} (metadata application={APP_NAME})", flush=True)
    if getattr(context, "dashboard_url", None):
        print(f"kvserve: Ray dashboard at http://{context.dashboard_url}", flush=True)
    print("kvserve: Ctrl-C to stop", flush=True)
    stop = threading.Event()
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    stop.wait()
    print("kvserve: shutting down", flush=True)
    serve.delete(APP_NAME)  # replicas first: they report to the cache manager until they stop
    cache_manager.shutdown(cache_manager.deployment_key(APP_NAME, "Generation"))
    serve.shutdown()
    ray.shutdown()
    return 0


def deploy_detached(config_path: str | None, overrides: dict[str, Any], grpc_port: int) -> int:
    """`kvserve up --detach`: deploy onto RAY_ADDRESS's cluster, or onto a Ray head started here
    as its own process, record it (cluster/local_head.py) and return; `kvserve down` stops it."""
    import sys

    from cluster import local_head

    config = load_config(config_path, overrides)
    address = os.environ.get("RAY_ADDRESS") or None
    previous = local_head.read_state()
    if previous is not None and previous.head_alive():
        print(f"kvserve: already up (Ray head at {previous.address}, gRPC at "
              f"127.0.0.1:{previous.grpc_port}); stop it first with: kvserve down",
              file=sys.stderr)
        return 1
    if address is None:
        replicas = config.autoscaling.max_replicas if config.autoscaling else config.replicas
        cpus = local_head.num_cpus_for(replicas * config.num_cpus_per_replica)
        state = local_head.start_head(cpus)
    else:
        state = local_head.UpState(address=address, started_head=False, grpc_port=grpc_port)
    state.grpc_port = grpc_port
    try:
        dashboard = _deploy(config, state, grpc_port)
    except BaseException as exc:
        if state.started_head:
            local_head.stop_head(state.head_pid, state.temp_dir)
        if isinstance(exc, Exception):
            print(f"kvserve: deployment failed: {exc}", file=sys.stderr)
            return 1
        raise
    state.dashboard_url = state.dashboard_url or dashboard
    local_head.write_state(state)
    print(f"kvserve: serving {config.model or 'SmolLM2-135M-Instruct'} with "
          f"{config.replicas} replica(s) on the Ray cluster at {state.address}"
          f"{' (started by kvserve)' if state.started_head else ''}", flush=True)
    print(f"kvserve: gRPC at 127.0.0.1:{grpc_port} (metadata application={APP_NAME})", flush=True)
    if state.dashboard_url:
        print(f"kvserve: Ray dashboard at {state.dashboard_url}", flush=True)
    print("kvserve: check with: kvserve status; stop with: kvserve down", flush=True)
    return 0


def _deploy(config: AppConfig, state: Any, grpc_port: int) -> str | None:
    import ray
    from ray import serve
    from ray.serve.config import gRPCOptions

    from cluster.local_head import apply_env, free_port

    apply_env(state.env)
    context = ray.init(address=state.address, log_to_driver=False)
    try:
        serve.start(
            grpc_options=gRPCOptions(port=grpc_port,
                                     grpc_servicer_functions=GRPC_SERVICER_FUNCTIONS),
            # HTTP is unused (gRPC only): a free loopback port, not 8000 shared with others
            http_options={"host": "127.0.0.1", "port": free_port()},
        )
        serve.run(build_app(config), name=APP_NAME, blocking=False)
        url = getattr(context, "dashboard_url", None)
        return f"http://{url}" if url else None
    finally:
        ray.shutdown()
