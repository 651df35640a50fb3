"""A local Ray cluster serving the kvserve app behind Ray Serve's gRPC proxy, for tests.

One Ray instance (with Serve and its gRPC proxy) is started per pytest session, on first use,
and kept while the serving tests run: starting Ray and Serve costs seconds on a 2-core machine,
and loading the model into every replica costs more. Each `serve_locally` deploys its app on that
cluster (`serve.run` replaces whatever app ran before); a caller that leaves the deployment as
it found it passes `reuse=True`, and the next caller asking for the same settings gets that same
deployment without a redeploy. Tests that kill replicas, restart Redis or change the replicas'
environment deploy their own (the default), which is deleted when their block ends.

Modules whose tests use this cluster set `USES_SHARED_RAY = "<group>"`: `tests/suite_plugin.py`
runs them together in group order, and shuts the cluster down before any other test (tests of
process lifetimes start their own heads and check that nothing is left behind; they must not see
this one)."""

from __future__ import annotations

import contextlib
import os
import re
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import grpc

from kvserve.cache_manager import actor as cache_manager
from kvserve.cluster import key_rings
from kvserve.cluster.app import GRPC_SERVICER_FUNCTIONS, build_app
from kvserve.cluster.client import call_metadata
from kvserve.cluster.deployment import ADMIN_ENV
from kvserve.cluster.http_ingress import PROXY_CALLBACK, PROXY_CALLBACK_ENV
from kvserve.cluster.local_head import free_port
from kvserve.cluster.ray_compat import NO_WORKER_PRESTART, QUIET_SERVE_ENV
from kvserve.v1 import generation_pb2 as pb
from kvserve.v1 import generation_pb2_grpc as pb_grpc

APP = "kvserve"  # the name kvserve's own clients (CLI, Locust) send as gRPC metadata
METADATA = (("application", APP),)
CLUSTER_CPUS = 2  # the session cluster's, this machine's cores
# The 1-replica app that the tests needing nothing special share (`reuse=True`)
DEFAULT_APP = {"kv_cache_memory": "512MiB"}
# The session cluster's replicas allow the admin endpoint (test-only failure injection,
# kvserve/cluster/deployment.py ADMIN_ENV): tests/test_serve_replica_health.py needs it, and a
# cluster started again for it alone costs a shutdown and a start (the test takes 50-58 s in CI
# with one, 28-32 s without)
CLUSTER_ENV = {ADMIN_ENV: "1"}
# The 2-replica app the routing, exactness and kill tests share
# max_expected_wait_s: these tests are not about admission, and on a loaded 2-core CI machine a
# replica measures ~130 prompt tokens/s, so 8 chats' turns would pass the default 30 s
TWO_REPLICAS = {"replicas": 2, "num_cpus_per_replica": 1, "kv_cache_memory": "256MiB",
                "max_expected_wait_s": 600}


@dataclass
class Served:
    stub: pb_grpc.GenerationStub
    handle: Any  # the deployment's DeploymentHandle
    target: str
    metrics_port: int
    http_url: str  # Serve's HTTP proxy: the OpenAI-compatible API
    app: str = APP  # the Serve application's name: gRPC metadata, cache-manager key
    api_key: str | None = None  # sent with every call when the app has keys

    @property
    def metadata(self) -> tuple[tuple[str, str], ...]:
        """The gRPC metadata that routes a call to this application (and its API key)."""
        return call_metadata(self.app, self.api_key)

    @property
    def manager_key(self) -> str:
        """The name of this application's cache-manager actor."""
        return cache_manager.deployment_key(self.app, "Generation")

    def stream(self, prompt: str, request_id: str = "", **params: Any
               ) -> list[pb.GenerateResponse]:
        request = pb.GenerateRequest(prompt=prompt, params=pb.SamplingParams(**params),
                                     request_id=request_id)
        return list(self.stub.Generate(request, metadata=self.metadata))

    def metrics(self) -> dict[str, list[tuple[str, float]]]:
        """Prometheus text of the node -> {family: [(labels, value), ...]}, without the samples
        of other Serve applications: the session's cluster served earlier apps, and their
        series must not make this app's metrics look present."""
        url = f"http://127.0.0.1:{self.metrics_port}/metrics"
        families: dict[str, list[tuple[str, float]]] = {}
        for line in urllib.request.urlopen(url, timeout=5).read().decode().splitlines():
            if line.startswith("#") or not line.strip():
                continue
            head, value = line.rsplit(" ", 1)
            name, _, labels = head.partition("{")
            app = re.search(r'(?:^|,)application="([^"]*)"', labels)
            if app is None or app.group(1) == self.app:
                families.setdefault(name, []).append((labels, float(value)))
        return families


@dataclass
class _Cluster:
    """The session's Ray + Serve, and the app deployed on it (if any)."""

    metrics_port: int
    grpc_port: int
    http_port: int
    env: dict[str, str]  # the environment variables its workers were started with
    channel: grpc.Channel
    app_args: dict[str, Any] | None = None  # settings of the deployed app, None if none
    served: Served | None = None
    reusable: bool = False  # the deployed app was left as deployed (see serve_locally)


_cluster: _Cluster | None = None
_deploys = 0  # apps deployed this session (for unique names)
# Counted across the session, so a test run can say how many starts it paid for.
STARTS = {"cluster": 0, "deploy": 0}


def _start_cluster(env: dict[str, str]) -> _Cluster:
    import ray
    from ray import serve
    from ray.serve.config import gRPCOptions

    metrics_port = free_port()
    # the HTTP proxy's key check (kvserve/cluster/http_ingress.py), read by the proxy at its start:
    # Ray's processes inherit this driver's environment
    os.environ[PROXY_CALLBACK_ENV] = PROXY_CALLBACK
    # Serve polling less while it idles between tests (ray_compat.QUIET_SERVE_ENV), also read
    # by Ray's processes from the environment they inherit
    os.environ.update(QUIET_SERVE_ENV)
    ray.init(
        num_cpus=CLUSTER_CPUS,
        include_dashboard=False,
        log_to_driver=False,
        _metrics_export_port=metrics_port,
        # no idle workers prestarted for the driver, as `kvserve up`'s heads (ray_compat)
        _system_config={"metrics_report_interval_ms": 1000, **NO_WORKER_PRESTART},
        # workers inherit the driver's environment at start; pass the asked-for variables
        # explicitly too, so the cluster's environment is what `env` says
        runtime_env={"env_vars": env} if env else None,
    )
    port, http_port = free_port(), free_port()  # after Ray's processes took theirs
    try:
        serve.start(
            grpc_options=gRPCOptions(port=port, grpc_servicer_functions=GRPC_SERVICER_FUNCTIONS),
            http_options={"host": "127.0.0.1", "port": http_port},
        )
    except BaseException:  # one failed start must not fail every later test (ray.init twice)
        serve.shutdown()
        ray.shutdown()
        raise
    STARTS["cluster"] += 1
    return _Cluster(metrics_port, port, http_port, dict(env),
                    grpc.insecure_channel(f"127.0.0.1:{port}"))


def _undeploy(cluster: _Cluster) -> None:
    """Delete the deployed app and its cache manager (+ its Redis); the cluster stays."""
    from ray import serve

    if cluster.app_args is None:
        return
    app = cluster.served.app if cluster.served else APP
    cluster.app_args, cluster.served, cluster.reusable = None, None, False
    cache_manager.shutdown(cache_manager.deployment_key(app, "Generation"))
    serve.delete(app)
    key_rings.forget(app)


def shutdown_cluster() -> None:
    """Stop the session's cluster (no-op if none runs)."""
    global _cluster
    if _cluster is None:
        return
    import ray
    from ray import serve

    cluster, _cluster = _cluster, None
    try:
        _undeploy(cluster)
    finally:
        cluster.channel.close()
        serve.shutdown()
        ray.shutdown()
        for name in QUIET_SERVE_ENV:  # heads this worker starts later keep Serve's defaults
            os.environ.pop(name, None)


def cluster_running() -> bool:
    return _cluster is not None


@contextlib.contextmanager
def serve_locally(app_args: dict[str, Any], *, reuse: bool = False,
                  env: dict[str, str] | None = None, name: str | None = None
                  ) -> Iterator[Served]:
    """The kvserve app with `app_args`, deployed on the session's cluster.

    reuse: the caller leaves the deployment as it found it (no kill, no restart, nothing left
    running), so it may be kept after the block for the next caller with equal `app_args`.
    env: environment variables the replicas need besides CLUSTER_ENV; a cluster started without
    exactly these is replaced (Ray's workers get their environment when the cluster starts).
    name: the application's name; by default a new one for each deployment. Serve's proxy
    keeps a deployment's request router across a redeploy under the same name, and that
    router still holds the deleted app's cache manager: its first lookup fails and it routes
    on load for a few seconds. Pass `APP` where a kvserve client (which sends "kvserve")
    calls the app.

    Unless `app_args` says otherwise, the replicas share the cluster's CPUs: one replica gets
    both (Ray sets a replica's torch threads, OMP_NUM_THREADS, to its CPUs: one thread would
    make every single-replica test compute at half speed), two get one each."""
    global _cluster, _deploys
    app_args = {"num_cpus_per_replica": CLUSTER_CPUS / app_args.get("replicas", 1), **app_args}
    env = CLUSTER_ENV | dict(env or {})
    if _cluster is not None and _cluster.env != env:
        shutdown_cluster()
    if _cluster is None:
        _cluster = _start_cluster(env)
    cluster = _cluster
    served = cluster.served
    if not (reuse and cluster.reusable and cluster.app_args == app_args and served is not None
            and (name is None or served.app == name)):
        from ray import serve

        _undeploy(cluster)
        _deploys += 1
        app = name or f"{APP}-{_deploys}"
        handle = serve.run(build_app(app_args), name=app)
        STARTS["deploy"] += 1
        cluster.app_args = dict(app_args)
        cluster.served = Served(pb_grpc.GenerationStub(cluster.channel), handle,
                                f"127.0.0.1:{cluster.grpc_port}", cluster.metrics_port,
                                f"http://127.0.0.1:{cluster.http_port}", app)
    cluster.reusable = False  # until this block ends cleanly
    assert cluster.served is not None
    try:
        yield cluster.served
    except BaseException:
        _undeploy(cluster)
        raise
    if reuse:
        cluster.reusable = True
    else:
        _undeploy(cluster)

