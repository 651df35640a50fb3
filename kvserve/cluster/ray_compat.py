"""Every use kvserve makes of Ray's private internals or undocumented behaviour, in one place.

Ray keeps no compatibility promise for `ray._private`, `ray._raylet`, `ray.serve._private` or
underscore attributes; a minor release may move or drop any of them. So nothing outside this
module touches them (tests/test_ray_compat.py scans the tree for it), each use below says why
kvserve needs it and which public API is missing, and tests/test_ray_compat.py checks that the
installed Ray still has every one, naming the symbol and the Ray version when it does not.
`pyproject.toml` pins `ray[serve]` to `TESTED_RAY`'s minor series for the same reason: to move
on, raise both, run tests/test_ray_compat.py and mend what it names here.

Ray is imported inside the functions, not at the top: `kvserve.cluster.local_head` (and so the CLI's
`status` / `down`) imports this module and starts without paying for `import ray`.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
from collections.abc import Callable, Iterator
from importlib import metadata
from typing import Any

logger = logging.getLogger(__name__)

TESTED_RAY = "2.60"  # the minor series whose internals this module was written against

# Every Ray internal used below, as (module, attribute path): tests/test_ray_compat.py imports
# each and fails naming it and the Ray version when the installed Ray no longer has it (and
# checks that this list covers every private import and underscore attribute in this module).
INTERNALS: tuple[tuple[str, str], ...] = (
    ("ray._raylet", "Config.initialize"),
    ("ray._raylet", "AuthenticationTokenLoader.instance"),
    ("ray._raylet", "AuthenticationTokenLoader.reset_cache"),
    ("ray._private.services", "find_bootstrap_address"),
    ("ray.serve.context", "_get_global_client"),
    ("ray.serve._private.client", "ServeControllerClient.get_serve_details"),
    ("ray.experimental.internal_kv", "_internal_kv_put"),
    ("ray.experimental.internal_kv", "_internal_kv_get"),
    ("ray.experimental.internal_kv", "_internal_kv_list"),
    ("ray.experimental.internal_kv", "_internal_kv_del"),
    ("ray.serve.request_router", "RequestRouter._probe_queue_lens"),
    ("ray.serve.request_router", "RequestRouter._choose_replica_for_request"),
    ("ray.serve._private.grpc_util", "gRPCGenericServer"),
    ("ray.serve._private.proxy", "gRPCProxy.service_handler_factory"),
    ("ray.serve._private.common", "DeploymentHandleSource.UNKNOWN"),
    ("ray.serve._private.common", "DeploymentID"),
    ("ray.serve._private.common", "RequestMetadata"),
    ("ray.serve._private.common", "RequestProtocol.GRPC"),
    ("ray.serve._private.common", "RequestProtocol.UNDEFINED"),
    ("ray.serve._private.common", "gRPCRequest"),
    ("ray.autoscaler._private.util", "prepare_config"),
    ("ray.autoscaler._private.util", "validate_config"),
    ("ray._private.ray_constants", "PROMETHEUS_SERVICE_DISCOVERY_FILE"),
)
# Attributes Serve sets on each RequestRouter instance (not on the class), used below.
ROUTER_INSTANCE_ATTRS = ("_deployment_id", "_use_replica_queue_len_cache", "_handle_source")


# A resource every Ray head node has, and no other node: asking for a sliver of it pins an actor
# to the head (Ray documents it for that; the name is Ray's convention, not an API, hence here).
HEAD_NODE_RESOURCE = "node:__internal_head__"


def head_node_pin() -> dict[str, float]:
    """Actor options `resources` that place it on the head node, taking nothing there."""
    return {HEAD_NODE_RESOURCE: 0.001}


def ray_version_problem(version: str | None = None) -> str | None:
    """Why `version` (default: the installed Ray's) is outside the tested series, else None."""
    if version is None:
        try:
            version = metadata.version("ray")
        except metadata.PackageNotFoundError:
            return "Ray is not installed"
    if version.split(".")[:2] != TESTED_RAY.split("."):
        return (f"Ray {version} is installed; kvserve's use of Ray internals "
                f"(kvserve/cluster/ray_compat.py) was tested with Ray {TESTED_RAY}.x only")
    return None


def check_ray_version() -> None:
    """Log a warning when the installed Ray is outside the tested series (once per process)."""
    problem = ray_version_problem()
    if problem is not None:
        logger.warning("%s; run tests/test_ray_compat.py to see what no longer holds", problem)


check_ray_version()


# -- signals: ray.init and ray.shutdown replace the driver's SIGTERM handler ------------------
@contextlib.contextmanager
def sigterm_handler_kept() -> Iterator[None]:
    """Puts back, after the block, the SIGTERM handler that was in force before it, unless that
    was the default. For `ray.init` and `ray.shutdown`: each installs its own SIGTERM handling
    (shutdown's ends the process at once, in C, whatever Python's handler says), which would
    skip the clean-up a `kvserve.process.sigterm_as_interrupt` or `signals_ignored` block exists
    for.

    Why here: ray.init's docstring says it overwrites the driver's SIGTERM handler, but not that
    shutdown does too, and Ray has no option to leave the handler alone. Checked by
    tests/test_local_head.py::test_a_driver_keeps_the_sigterm_handler_it_had (a real head)."""
    main = threading.current_thread() is threading.main_thread()
    previous = signal.getsignal(signal.SIGTERM) if main else None
    try:
        yield
    finally:
        if previous not in (None, signal.SIG_DFL):
            signal.signal(signal.SIGTERM, previous)


# -- token authentication: re-read after the environment changed ------------------------------
def reload_auth_config() -> None:
    """Make Ray re-read RAY_AUTH_MODE and the auth token (RAY_AUTH_TOKEN_PATH) after this process
    changed them, before ray.init.

    Why: Ray reads its config (RAY_AUTH_MODE among it) once, when `ray._raylet` is imported, and
    caches the token on first use. `kvserve status` / `down` learn the head's token path from
    the state file only after Ray may have been imported (`kvserve.cluster.local_head.apply_env`).
    Ray
    has no public call to reload either; `ray._raylet.Config.initialize("")` is what Ray itself
    runs at import, and `AuthenticationTokenLoader.reset_cache` drops the cached token."""
    from ray._raylet import AuthenticationTokenLoader, Config

    Config.initialize("")
    AuthenticationTokenLoader.instance().reset_cache()


# -- nodes kvserve starts on one machine (kvserve/cluster/local_head.py)
# -------------------------------
# Why: a raylet starts one idle Python worker per CPU it declares as soon as a driver connects,
# so that tasks start fast. Simulated nodes (`kvserve up --local-nodes 3 --cpus-per-node 4`)
# declare more CPUs than the machine has: a dozen idle workers, each importing Ray, on 2 cores,
# beside the replicas starting. Ray's system config, read from RAY_<name> at raylet start; no
# public option. Actors (replicas, the cache manager) start their own workers regardless.
NO_WORKER_PRESTART = {"prestart_worker_first_driver": False, "enable_worker_prestart": False}
# the same, as the raylet reads it from its environment (`ray start`'s processes)
NO_WORKER_PRESTART_ENV = {f"RAY_{name}": str(int(value))
                          for name, value in NO_WORKER_PRESTART.items()}

# -- a quieter Serve for clusters that share 2 cores with their tests ---------------------------
# Why: an idle Serve instance polls. Its controller runs its control loop every 0.1 s (each
# iteration asks the GCS for every node's resources), and each replica and proxy exports its
# cached request metrics every 0.1 s. On the 2-core CI machine that is ~3.5 % of a core per
# cluster doing nothing (measured with one idle 2-replica app: 16.3 % of a core in
# all, 12.9 % with these), all through the suite. Serve reads both from the environment at
# import (ray.serve._private.constants), with no public option. Slower by at most 0.15 s to act
# on a change, and by 0.9 s to show a request in Prometheus. Test clusters only: `kvserve up`
# keeps Serve's defaults.
QUIET_SERVE_ENV = {"RAY_SERVE_CONTROL_LOOP_INTERVAL_S": "0.25",
                   "RAY_SERVE_METRICS_EXPORT_INTERVAL_MS": "1000"}
# the constants they set, as Serve names them
QUIET_SERVE_CONSTANTS = {"RAY_SERVE_CONTROL_LOOP_INTERVAL_S": "CONTROL_LOOP_INTERVAL_S",
                         "RAY_SERVE_METRICS_EXPORT_INTERVAL_MS":
                         "RAY_SERVE_METRICS_EXPORT_INTERVAL_MS"}


# -- the cluster `ray start` recorded, and Serve's details ------------------------------------
def recorded_cluster_address(temp_dir: str | None = None) -> str | None:
    """The GCS address of the cluster `ray start` last recorded on this machine
    (`<temp_dir, default /tmp/ray>/ray_current_cluster`), or None.

    Why: `kvserve status` / `down` talk to that cluster when nothing else names one. The public
    way, `ray.init(address="auto")`, finds it only by connecting (and ~30 s of retries when
    nothing listens); `ray._private.services.find_bootstrap_address` only reads the record."""
    from ray._private.services import find_bootstrap_address

    return find_bootstrap_address(temp_dir) or None


def serve_details() -> dict[str, Any] | None:
    """Serve's full state (`ServeInstanceDetails`' fields: applications, deployments, replicas
    with ids, pids and node IPs, gRPC options), or None when no Serve controller runs.

    Why: `kvserve status` lists replicas. The public `serve.status()` has no replica rows, and
    the dashboard's REST API needs the dashboard's address and token; the controller client
    from `ray.serve.context._get_global_client` (what `serve status` uses) has them, and with
    `raise_if_no_controller_running=False` it does not start Serve where none runs."""
    from ray.serve.context import _get_global_client

    client = _get_global_client(raise_if_no_controller_running=False)
    return None if client is None else client.get_serve_details()


# -- the GCS internal KV (replica status rows) ------------------------------------------------
def kv_put(key: bytes, value: str | bytes, namespace: str) -> None:
    """Store `value` under `key` in the GCS's internal KV (overwriting).

    Why: each replica publishes its status row where a separate driver (`kvserve status`) can
    read it without going through the replica. Ray's only key-value store in the GCS is
    `ray.experimental.internal_kv`, whose functions are underscored; no public equivalent."""
    from ray.experimental.internal_kv import _internal_kv_put

    _internal_kv_put(key, value, overwrite=True, namespace=namespace)


def kv_get_prefix(prefix: str, namespace: str) -> list[bytes | None]:
    """The values of every key under `prefix` (None for a key deleted meanwhile)."""
    from ray.experimental.internal_kv import _internal_kv_get, _internal_kv_list

    keys = _internal_kv_list(prefix, namespace=namespace)
    return [_internal_kv_get(key, namespace=namespace) for key in keys]


def kv_get(key: bytes, namespace: str) -> bytes | None:
    """The value under `key`, None if there is none (the key rings the gRPC proxy reads)."""
    from ray.experimental.internal_kv import _internal_kv_get

    return _internal_kv_get(key, namespace=namespace)


def kv_delete_prefix(prefix: str, namespace: str) -> None:
    """Delete every key under `prefix`."""
    from ray.experimental.internal_kv import _internal_kv_del

    _internal_kv_del(prefix, del_by_prefix=True, namespace=namespace)


# -- the Serve request router (kvserve/cluster/router.py)
# ---------------------------------------------
def routed_deployment(router: Any) -> tuple[str, str]:
    """(application, deployment) a `RequestRouter` routes for.

    Why: the router asks that deployment's cache manager. `RequestRouter.app_name` is public,
    the deployment's name is not (only the `_deployment_id` Serve constructs it with)."""
    return router.app_name, router._deployment_id.name


def queue_len_cache_enabled(router: Any) -> bool:
    """Whether Serve keeps this router's queue length cache up to date (else probe every time).

    Why: the router measures load as Serve's own routers do. `replica_queue_len_cache` is public
    but whether Serve feeds it is only in `_use_replica_queue_len_cache`."""
    return bool(router._use_replica_queue_len_cache)


def routes_for_a_proxy(router: Any) -> bool:
    """Whether a `RequestRouter` routes for one of Serve's proxies (not a driver's or a
    replica's handle).

    Why: only a proxy's router will route client traffic for sure, so only there is loading the
    tokenizer ahead of the first request worth its cost. Serve constructs the router with its
    `handle_source` but keeps it in `_handle_source` only."""
    return getattr(router._handle_source, "value", None) == "PROXY"


async def probe_queue_lens(router: Any, replicas: list[Any]) -> list[tuple[Any, int | None]]:
    """(replica, its ongoing requests or None when it did not answer in time), asking each.

    Why: Serve's `_probe_queue_lens` applies Serve's deadline settings, updates the queue length
    cache and the gauges, and drops a replica whose actor died; the public
    `RunningReplica.get_queue_len` alone would skip all of that."""
    return await router._probe_queue_lens(replicas, 0)


# -- the gRPC proxy (kvserve/cluster/grpc_ingress.py)
# -------------------------------------------------
# in Ray's ActorDiedError messages, and ActorUnavailableError's (the replica's node died or is
# unreachable: its process may be gone with it)
REPLICA_DIED_WORDS = ("actor died", "actor is dead", "is unavailable:")


def replace_proxy_handler_factory(server: Any,
                                  wrap: Callable[[Callable[..., Any]], Callable[..., Any]]) -> bool:
    """Replace the handler factory of Ray Serve's gRPC proxy server with `wrap(factory)`; False
    (nothing changed) when `server` has none.

    Why: Serve's proxy builds every method handler with `service_handler_factory` on its private
    `gRPCGenericServer` (the server a `grpc_servicer_functions` entry is handed), and its
    streaming handler can lose a client's cancel (see kvserve/cluster/grpc_ingress.py). Serve has no
    hook to wrap the handlers it builds."""
    factory = getattr(server, "service_handler_factory", None)
    if factory is None:
        return False
    server.service_handler_factory = wrap(factory)
    return True


def is_replica_death(code: Any, details: str | None) -> bool:
    """Whether a gRPC status the proxy set means "the replica died under the request".

    Why: Serve reports an `ActorDiedError` (the replica's process died) and an
    `ActorUnavailableError` (its node died: the connection to it closed) as INTERNAL with the
    error's text as details and nothing else to tell them from a bug; kvserve turns them into
    the retryable UNAVAILABLE. So it matches Ray's wording, which no API promises."""
    import grpc

    text = (details or "").lower()
    return code == grpc.StatusCode.INTERNAL and any(w in text for w in REPLICA_DIED_WORDS)


# -- for tests: Serve's router and requests, built outside Serve ------------------------------
def new_request_router(cls: type, app_name: str, deployment_name: str, *,
                       use_queue_len_cache: bool = True, node_id: str = "node",
                       handle_source: str = "UNKNOWN") -> Any:
    """A `RequestRouter` subclass instance, constructed as Serve constructs it in a handle
    (`handle_source`: "UNKNOWN" as in a driver, "PROXY" as in Serve's proxies, "REPLICA").

    Why: tests drive the router through Serve's own routing loop without a cluster; the
    constructor's arguments (`DeploymentID`, `DeploymentHandleSource`) are Serve-private."""
    from ray.serve._private.common import DeploymentHandleSource

    return cls(deployment_id=deployment_id(app_name, deployment_name),
               handle_source=DeploymentHandleSource(handle_source),
               use_replica_queue_len_cache=use_queue_len_cache, self_node_id=node_id,
               prefer_local_node_routing=True)


def deployment_id(app_name: str, deployment_name: str) -> Any:
    """Serve's `DeploymentID` (a public `ReplicaID` needs one; the class is Serve-private)."""
    from ray.serve._private.common import DeploymentID

    return DeploymentID(name=deployment_name, app_name=app_name)


def request_metadata(request_id: str, call_method: str, grpc: bool) -> Any:
    """Serve's `RequestMetadata` for a handle call (`grpc`: as the gRPC proxy sends it)."""
    from ray.serve._private.common import RequestMetadata, RequestProtocol

    protocol = RequestProtocol.GRPC if grpc else RequestProtocol.UNDEFINED
    return RequestMetadata(request_id=request_id, internal_request_id=request_id,
                           call_method=call_method, _request_protocol=protocol)


def grpc_request(message: Any) -> Any:
    """Serve's `gRPCRequest` around a user message: what the proxy pickles into a handle call."""
    from ray.serve._private.common import gRPCRequest

    return gRPCRequest(user_request_proto=message)


async def route_request(router: Any, pending_request: Any) -> Any:
    """The replica Serve's routing loop picks for `pending_request` (ranking by the router's
    `choose_replicas`, skipping full replicas, backing off), as a handle call would get it."""
    return await router._choose_replica_for_request(pending_request)


# -- for tests: Ray's own validation of the infra files ---------------------------------------
def validate_cluster_launcher_config(config: dict[str, Any]) -> None:
    """Raise if `config` is not a valid `ray up` cluster launcher config.

    Why: `ray up` validates with `ray.autoscaler._private.util`; there is no public validator."""
    from ray.autoscaler._private.util import prepare_config, validate_config

    validate_config(prepare_config(config))


def prometheus_service_discovery_file() -> str:
    """The file name (under the session dir's parent) where Ray writes Prometheus targets.

    Why: infra/monitoring/prometheus.yml must read the file Ray writes; the name is a
    constant in `ray._private.ray_constants` only."""
    from ray._private.ray_constants import PROMETHEUS_SERVICE_DISCOVERY_FILE

    return PROMETHEUS_SERVICE_DISCOVERY_FILE
