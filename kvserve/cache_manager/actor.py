"""The central cache manager as a named, detached Ray actor: one per deployment.

The first replica of a deployment starts it (`get_or_start`); Ray restarts it if it dies, and
the restarted manager rebuilds Redis from the replicas' full reports. Without a Redis URL it
runs an embedded redis-server in a directory named after the node and deployment; the server
dies with the manager's process, and a manager starting up removes the directories (and any
server still answering there) that managers gone before it left behind.

Where it runs: the head node (the deployment asks for the head's own resource, with no CPUs),
which outlives every worker node; so a worker node's failure never takes the index with it.
The embedded server listens on a unix socket only: the manager is its only client (replicas
and routers talk to the actor, never to Redis), wherever they run, so no port and no password
are needed. An external Redis (`redis_url`) is for running the index apart from Ray.

`kvserve down` calls `shutdown`: it deletes the deployment's keys, stops the embedded server and
ends the actor.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from pathlib import Path

import ray

from kvserve.cache_manager.index import LEASE_TTL_S, KVIndex, ReplicaReport
from kvserve.cache_manager.manager import CacheManager, ReplicaState
from kvserve.cache_manager.redis_server import REDIS_URL_ENV, connect, remove_stale

MANAGER_NAMESPACE = "kvserve"
EMBEDDED_PREFIX = "kvserve-redis-"  # + node + deployment: an embedded server's directory


def deployment_key(app_name: str, deployment_name: str) -> str:
    """Names one deployment cluster-wide: its manager actor and its Redis namespace."""
    return f"{app_name}.{deployment_name}"


def manager_name(deployment: str) -> str:
    return f"kvserve-cache-manager:{deployment}"


# Why two groups: a threaded actor runs one group's calls in order on its thread. Reports keep
# that order (a replica's deltas apply in sequence); the routers' reads get a thread of their
# own, so a `match` does not queue behind reports being written to Redis. On a loaded 2-core
# host a match waiting behind them can pass the router's 0.5 s deadline, and the proxy then
# routes on load, away from the replica holding the prompt, for the next 5 s. The reads
# only read Redis (redis-py's client is thread-safe) and one attribute.
ROUTING_GROUP = "routing"


@ray.remote(num_cpus=0, max_restarts=-1, concurrency_groups={ROUTING_GROUP: 1})
class CacheManagerActor:
    def __init__(self, deployment: str, redis_url: str | None, lease_ttl_s: float) -> None:
        self.deployment = deployment
        if not (redis_url or os.environ.get(REDIS_URL_ENV)):
            remove_stale(list(_embedded_dir(deployment).parent.glob(f"{EMBEDDED_PREFIX}*")))
        self.redis = connect(redis_url, _embedded_dir(deployment))
        self.manager = CacheManager(KVIndex(self.redis.client, deployment, lease_ttl_s))

    def report(self, report: ReplicaReport) -> bool:
        return self.manager.report(report)

    @ray.method(concurrency_group=ROUTING_GROUP)
    def match(self, block_hashes: list[str]) -> dict[str, int]:
        return self.manager.match(block_hashes)

    @ray.method(concurrency_group=ROUTING_GROUP)
    def block_size(self) -> int | None:
        return self.manager.block_size

    def redis_url(self) -> str:
        return self.redis.url

    def summary(self) -> dict[str, dict]:
        return self.manager.summary()

    def check(self, states: list[ReplicaState]) -> list[str]:
        return self.manager.check(states)

    def node_id(self) -> str:
        """The Ray node it runs on (the head's, by the deployment's placement)."""
        return ray.get_runtime_context().get_node_id()

    def stats(self) -> dict[str, int]:
        return {"full_reports": self.manager.num_full_reports}

    def shutdown(self) -> int:
        """Delete this deployment's keys (and stop an embedded server); returns keys deleted."""
        deleted = self.manager.delete_all()
        if self.redis.embedded:
            self.redis.stop_server()
            shutil.rmtree(_embedded_dir(self.deployment), ignore_errors=True)
        ray.actor.exit_actor()
        return deleted


def get_or_start(deployment: str, redis_url: str | None = None,
                 lease_ttl_s: float = LEASE_TTL_S,
                 resources: dict[str, float] | None = None) -> ray.actor.ActorHandle:
    """`resources`: where it must run (the deployment pins it to the head node)."""
    return CacheManagerActor.options(
        name=manager_name(deployment), namespace=MANAGER_NAMESPACE, lifetime="detached",
        get_if_exists=True, resources=resources or {},
        # not in the placement group of the replica starting it (a tensor-parallel one's)
        scheduling_strategy="DEFAULT",
    ).remote(deployment, redis_url, lease_ttl_s)


def get(deployment: str) -> ray.actor.ActorHandle | None:
    try:
        return ray.get_actor(manager_name(deployment), namespace=MANAGER_NAMESPACE)
    except ValueError:
        return None


def shutdown(deployment: str, timeout_s: float = 10.0) -> int | None:
    """Stop the deployment's manager and delete its keys; None if it was not running."""
    actor = get(deployment)
    if actor is None:
        return None
    try:
        return ray.get(actor.shutdown.remote(), timeout=timeout_s)
    except ray.exceptions.RayActorError:  # exit_actor ends the call before it answers
        return 0
    finally:
        ray.kill(actor, no_restart=True)


def _embedded_dir(deployment: str) -> Path:
    node = ray.get_runtime_context().get_node_id()[:12]
    safe = re.sub(r"[^A-Za-z0-9_.-]", "_", deployment)
    return Path(tempfile.gettempdir()) / f"{EMBEDDED_PREFIX}{node}-{safe}"
