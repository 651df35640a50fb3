"""Per-replica status rows (running / waiting requests, KV usage) in Ray's GCS internal KV.

Every replica publishes its row about once a second from a daemon thread under
`kvserve/replicas/<replica id>`; `kvserve status`, a separate driver on the same cluster, reads
them all. A replica that dies stops refreshing its row, so readers drop rows older than
`STALE_AFTER_S` and rows of replicas that Serve no longer lists.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field

from kvserve.cluster import ray_compat

KEY_PREFIX = "kvserve/replicas/"
NAMESPACE = "kvserve"
PUBLISH_INTERVAL_S = 1.0
STALE_AFTER_S = 5.0

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ReplicaStatus:
    replica_id: str
    pid: int
    node_ip: str
    running: int  # requests being decoded
    waiting: int  # requests waiting for admission
    kv_cache_usage: float  # fraction of KV blocks in use, 0-1
    updated_at: float  # unix time
    rss_bytes: int = 0  # the replica process's resident memory (soak tests watch it)
    node_id: str = ""  # the Ray node it runs on
    gpu_ids: list[str] = field(default_factory=list)  # the GPUs Ray gave it (logical ones too)
    device: str = ""  # where its engine runs: cpu, cuda:0, ...
    kv_pool_bytes: int = 0  # of rss_bytes, the KV pool's pages written so far (EngineLoad)
    rank_pids: list[int] = field(default_factory=list)  # tensor-parallel ranks 1..N-1

    def to_dict(self) -> dict:
        return asdict(self)

    def to_json(self) -> bytes:
        return json.dumps(self.to_dict()).encode()

    @classmethod
    def from_json(cls, data: bytes | str) -> ReplicaStatus:
        values = json.loads(data)
        return cls(
            replica_id=str(values["replica_id"]), pid=int(values["pid"]),
            node_ip=str(values["node_ip"]), running=int(values["running"]),
            waiting=int(values["waiting"]), kv_cache_usage=float(values["kv_cache_usage"]),
            updated_at=float(values["updated_at"]), rss_bytes=int(values.get("rss_bytes", 0)),
            node_id=str(values.get("node_id", "")),
            gpu_ids=[str(g) for g in values.get("gpu_ids", [])],
            device=str(values.get("device", "")),
            kv_pool_bytes=int(values.get("kv_pool_bytes", 0)),
            rank_pids=[int(p) for p in values.get("rank_pids", [])],
        )


def current_rows(
    rows: Iterable[ReplicaStatus], *, live_ids: Iterable[str] | None = None,
    now: float | None = None, max_age: float = STALE_AFTER_S,
) -> dict[str, ReplicaStatus]:
    """Replica id -> row, without stale rows and, given `live_ids`, rows Serve doesn't list."""
    now = time.time() if now is None else now
    live = None if live_ids is None else set(live_ids)
    out: dict[str, ReplicaStatus] = {}
    for row in rows:
        if now - row.updated_at > max_age or (live is not None and row.replica_id not in live):
            continue
        if row.replica_id not in out or row.updated_at > out[row.replica_id].updated_at:
            out[row.replica_id] = row
    return out


def parse_rows(values: Iterable[bytes | str | None]) -> list[ReplicaStatus]:
    """Rows from stored values; missing or malformed ones (other versions, races) are skipped."""
    rows = []
    for value in values:
        if value is None:
            continue
        try:
            rows.append(ReplicaStatus.from_json(value))
        except (ValueError, KeyError, TypeError):
            continue
    return rows


# -- the GCS side (needs a connected Ray worker or driver) -----------------------------------
def _key(replica_id: str) -> bytes:
    return f"{KEY_PREFIX}{replica_id}".encode()


def put(row: ReplicaStatus) -> None:
    ray_compat.kv_put(_key(row.replica_id), row.to_json(), namespace=NAMESPACE)


def read_all() -> list[ReplicaStatus]:
    """Every stored row, stale ones included."""
    return parse_rows(ray_compat.kv_get_prefix(KEY_PREFIX, namespace=NAMESPACE))


def read_current(live_ids: Iterable[str] | None = None) -> dict[str, ReplicaStatus]:
    return current_rows(read_all(), live_ids=live_ids)


def delete_all() -> None:
    ray_compat.kv_delete_prefix(KEY_PREFIX, namespace=NAMESPACE)


class StatusPublisher:
    """Publishes one replica's row every `interval` seconds from a daemon thread.

    `snapshot` returns (running, waiting, kv_cache_usage[, kv_pool_ram_bytes]): an `EngineLoad`;
    it is called from the thread, so it must only read (lengths of the scheduler's queues, the
    block pool's usage).
    """

    def __init__(self, snapshot: Callable[[], tuple[int, int, float] | tuple[int, int, float, int]],
                 replica_id: str | None = None, node_ip: str | None = None,
                 interval: float = PUBLISH_INTERVAL_S, device: str = "",
                 rank_pids: list[int] | None = None) -> None:
        self.snapshot = snapshot
        self.replica_id = replica_id or _replica_id()
        self.node_ip = node_ip or _node_ip()
        self.node_id, self.gpu_ids = placement()
        self.device = device
        self.rank_pids = list(rank_pids or [])
        self.pid = os.getpid()
        self.interval = interval
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._warned = False

    def current(self) -> ReplicaStatus:
        running, waiting, usage, *pool = self.snapshot()
        return ReplicaStatus(self.replica_id, self.pid, self.node_ip, int(running), int(waiting),
                             float(usage), time.time(), _resident_bytes(), self.node_id,
                             list(self.gpu_ids), self.device, int(pool[0]) if pool else 0,
                             self.rank_pids)

    def publish_once(self) -> None:
        try:
            put(self.current())
        except Exception:  # noqa: BLE001 - status is best effort; serving must go on
            if not self._warned:
                logger.warning("kvserve: could not publish replica status", exc_info=True)
                self._warned = True

    def start(self) -> StatusPublisher:
        self.publish_once()  # a row exists as soon as the replica is up
        self._thread = threading.Thread(target=self._run, name="kvserve-replica-status",
                                        daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.publish_once()


def _resident_bytes() -> int:
    import psutil  # a Ray dependency

    return int(psutil.Process().memory_info().rss)


def _replica_id() -> str:
    try:
        from ray import serve

        return serve.get_replica_context().replica_id.unique_id
    except Exception:  # noqa: BLE001 - outside a replica (tests): the process is the replica
        return f"pid-{os.getpid()}"


def placement() -> tuple[str, list[str]]:
    """This process's Ray node id and the GPU ids Ray assigned it (("", []) outside Ray)."""
    try:
        import ray

        if not ray.is_initialized():  # get_runtime_context() would start a cluster
            return "", []
        context = ray.get_runtime_context()
        return context.get_node_id(), [str(g) for g in
                                       context.get_accelerator_ids().get("GPU", [])]
    except Exception:  # noqa: BLE001 - outside a Ray worker (tests)
        return "", []


def _node_ip() -> str:
    try:
        import ray

        return ray.util.get_node_ip_address()
    except Exception:  # noqa: BLE001
        return "127.0.0.1"
