"""A local Ray cluster serving the kvserve app behind Ray Serve's gRPC proxy, for tests."""

from __future__ import annotations

import contextlib
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import grpc

from cache_manager import actor as cache_manager
from cluster.app import GRPC_SERVICER_FUNCTIONS, build_app
from cluster.local_head import free_port
from kvserve.v1 import generation_pb2 as pb
from kvserve.v1 import generation_pb2_grpc as pb_grpc

APP = "kvserve"
METADATA = (("application", APP),)


@dataclass
class Served:
    stub: pb_grpc.GenerationStub
    handle: Any  # the deployment's DeploymentHandle
    target: str
    metrics_port: int

    def stream(self, prompt: str, **params: Any) -> list[pb.GenerateResponse]:
        request = pb.GenerateRequest(prompt=prompt, params=pb.SamplingParams(**params))
        return list(self.stub.Generate(request, metadata=METADATA))

    def metrics(self) -> dict[str, list[tuple[str, float]]]:
        """Prometheus text of the node -> {family: [(labels, value), ...]}."""
        url = f"http://127.0.0.1:{self.metrics_port}/metrics"
        families: dict[str, list[tuple[str, float]]] = {}
        for line in urllib.request.urlopen(url, timeout=5).read().decode().splitlines():
            if line.startswith("#") or not line.strip():
                continue
            head, value = line.rsplit(" ", 1)
            name, _, labels = head.partition("{")
            families.setdefault(name, []).append((labels, float(value)))
        return families


@contextlib.contextmanager
def serve_locally(app_args: dict[str, Any]) -> Iterator[Served]:
    import ray
    from ray import serve
    from ray.serve.config import gRPCOptions

    metrics_port, port = free_port(), free_port()
    ray.init(
        num_cpus=2,
        include_dashboard=False,
        log_to_driver=False,
        _metrics_export_port=metrics_port,
        _system_config={"metrics_report_interval_ms": 1000},
    )
    serve.start(
        grpc_options=gRPCOptions(port=port, grpc_servicer_functions=GRPC_SERVICER_FUNCTIONS),
        http_options={"host": "127.0.0.1", "port": free_port()},
    )
    handle = serve.run(build_app(app_args), name=APP)
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    try:
        yield Served(pb_grpc.GenerationStub(channel), handle, f"127.0.0.1:{port}", metrics_port)
    finally:
        channel.close()
        cache_manager.shutdown(cache_manager.deployment_key(APP, "Generation"))  # + its Redis
        serve.shutdown()
        ray.shutdown()
