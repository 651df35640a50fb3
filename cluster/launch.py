"""`kvserve up`: start (or join) Ray, deploy the app behind Ray Serve's gRPC proxy, serve until
Ctrl-C, then shut down cleanly."""

from __future__ import annotations

import os
import signal
import threading
from pathlib import Path
from typing import Any

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
    serve.shutdown()
    ray.shutdown()
    return 0
