"""`kvserve status` and `kvserve down`: inspect or stop a deployment on a running Ray cluster.

Which cluster: `--address`, else RAY_ADDRESS, else the one `kvserve up --detach` recorded, else
the last one `ray start` recorded on this machine. Never "any Ray process found on this host":
that could be somebody else's cluster.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

from kvserve.cluster import local_head, ray_compat, replica_status
from kvserve.columns import aligned

APP_NAME = "kvserve"


class NothingRunning(Exception):
    pass


def _target(address: str | None,
            given: local_head.UpState | None = None) -> tuple[str, local_head.UpState | None]:
    if given is not None:  # a deployment its starter keeps to itself (kvserve loadtest's)
        return given.address, given
    state = local_head.read_live_state()
    explicit = address or os.environ.get("RAY_ADDRESS") or None
    if explicit and explicit != "auto":
        recorded = state if state is not None and state.address == explicit else None
        return explicit, recorded
    if state is not None:
        return state.address, state
    found = ray_compat.recorded_cluster_address()  # what `ray start` recorded
    if not found:
        raise NothingRunning("no Ray cluster to talk to (none started by `kvserve up --detach`, "
                             "RAY_ADDRESS unset); start one with: kvserve up --detach")
    return found, None


def connect(address: str | None,
            state: local_head.UpState | None = None) -> tuple[str, local_head.UpState | None]:
    """Connect as a driver to `state`'s cluster if given, else to the one `_target` picks."""
    target, state = _target(address, state)
    if not local_head.reachable(target):
        raise NothingRunning(f"no Ray cluster at {target}")
    try:
        local_head.connect_driver(target, state.env if state else None, logging_level="ERROR")
    except (ConnectionError, RuntimeError) as exc:
        raise NothingRunning(f"cannot connect to the Ray cluster at {target}: {exc}") from exc
    return target, state


# -- status --------------------------------------------------------------------------------
def collect_status(app_name: str = APP_NAME) -> dict[str, Any] | None:
    """The application's state, its deployments' replica counts by state and one row per
    replica Serve lists, with the replica's published running / waiting / KV usage (None while
    it has no fresh row). None when the application is not deployed."""
    from ray.serve.schema import ServeInstanceDetails

    serve_details = ray_compat.serve_details()
    if serve_details is None:
        return None
    details = ServeInstanceDetails(**serve_details)
    app = details.applications.get(app_name)
    if app is None:
        return None
    live = [r for d in app.deployments.values() for r in d.replicas]
    rows = replica_status.read_current(live_ids=[r.replica_id for r in live])
    cache = _cache_summary(app_name)
    deployments, replicas = {}, []
    for name, dep in app.deployments.items():
        counts: dict[str, int] = {}
        for r in dep.replicas:
            counts[str(r.state.value)] = counts.get(str(r.state.value), 0) + 1
        deployments[name] = {"status": str(dep.status.value), "message": dep.message,
                             "target_replicas": dep.target_num_replicas,
                             "replica_states": counts}
        for r in dep.replicas:
            row = rows.get(r.replica_id)
            replicas.append({
                "replica_id": r.replica_id, "deployment": name, "state": str(r.state.value),
                "pid": r.pid, "node_ip": r.node_ip, "node_id": r.node_id,
                "gpu_ids": row.gpu_ids if row else None, "device": row.device if row else None,
                # tensor parallelism: rank 0 is the replica's process, ranks 1.. these
                "tensor_parallel_size": 1 + len(row.rank_pids) if row else None,
                "rank_pids": row.rank_pids if row else None,
                "running": row.running if row else None, "waiting": row.waiting if row else None,
                "kv_cache_usage": row.kv_cache_usage if row else None,
                "rss_mib": round(row.rss_bytes / 1024**2) if row and row.rss_bytes else None,
                # of which the KV pool's pages written so far (a CPU pool commits as used)
                "kv_pool_mib": round(row.kv_pool_bytes / 1024**2, 1) if row else None,
                "updated_at": row.updated_at if row else None,
                **_cache_columns(cache.get(r.replica_id)),
            })
    grpc = details.grpc_options
    return {"application": app_name, "status": str(app.status.value), "message": app.message,
            "grpc_port": getattr(grpc, "port", None), "deployments": deployments,
            "replicas": replicas}


def _cache_summary(app_name: str) -> dict[str, dict]:
    """Replica id -> its usage in the cache manager's index ({} without a manager)."""
    import ray

    from kvserve.cache_manager import actor as cache_manager

    manager = cache_manager.get(cache_manager.deployment_key(app_name, "Generation"))
    if manager is None:
        return {}
    try:
        return ray.get(manager.summary.remote(), timeout=10)
    except Exception:  # noqa: BLE001 - status still shows what Serve knows
        return {}


def _cache_columns(usage: dict | None) -> dict[str, Any]:
    """KV host-tier usage, cached blocks and prefix hit rate (None where unknown)."""
    if usage is None:
        return {"kv_host_usage": None, "kv_cached_blocks": None, "prefix_cache_hit_rate": None}
    host, queried = usage["host_total"], usage["prefix_queried_tokens"]
    return {"kv_host_usage": usage["host_used"] / host if host else None,
            "kv_cached_blocks": usage["device_cached"] + usage["host_cached"],
            "prefix_cache_hit_rate": usage["prefix_hit_tokens"] / queried if queried else None}


def status(address: str | None, as_json: bool) -> int:
    try:
        target, state = connect(address)
    except NothingRunning as exc:
        print(f"kvserve: nothing deployed: {exc}", file=sys.stderr)
        return 1

    try:
        report = collect_status()
    finally:
        local_head.disconnect_driver()
    if report is None:
        print(f"kvserve: nothing deployed: no '{APP_NAME}' application on the Ray cluster at "
              f"{target}", file=sys.stderr)
        return 1
    report["ray_address"] = target
    if state is not None and state.dashboard_url:
        report["dashboard_url"] = state.dashboard_url
    print(json.dumps(report, indent=2) if as_json else format_status(report))
    return 0


def format_status(report: dict[str, Any]) -> str:
    lines = [f"application {report['application']}: {report['status']}"
             f"{' - ' + report['message'] if report['message'] else ''}",
             f"  Ray {report.get('ray_address', '?')}, gRPC port {report.get('grpc_port')}"
             + (f", dashboard {report['dashboard_url']}" if report.get("dashboard_url") else "")]
    for name, dep in report["deployments"].items():
        counts = ", ".join(f"{k}={v}" for k, v in sorted(dep["replica_states"].items()))
        lines.append(f"deployment {name}: {dep['status']} ({counts or 'no replicas'}; "
                     f"target {dep['target_replicas']})")
    header = ("REPLICA", "PID", "TP RANK PIDS", "NODE", "GPU", "STATE", "RUNNING", "WAITING",
              "KV %", "HOST KV %", "CACHED", "PREFIX HIT %", "RSS MiB")
    table = [header] + [(
        r["replica_id"], str(r["pid"] or "-"), _ranks(r), (r.get("node_id") or "-")[:8],
        ",".join(r.get("gpu_ids") or []) or "-", r["state"], _or_dash(r["running"]),
        _or_dash(r["waiting"]), _percent(r["kv_cache_usage"]), _percent(r.get("kv_host_usage")),
        _or_dash(r.get("kv_cached_blocks")), _percent(r.get("prefix_cache_hit_rate")),
        _or_dash(r.get("rss_mib")),
    ) for r in report["replicas"]]
    lines.append("")
    lines += aligned(table)
    return "\n".join(lines)


def _ranks(replica: dict[str, Any]) -> str:
    """Tensor-parallel ranks 1.. by pid ("1:4711,2:4712"); "-" without tp."""
    pids = replica.get("rank_pids") or []
    return ",".join(f"{i}:{pid}" for i, pid in enumerate(pids, start=1)) or "-"


def _or_dash(value: Any) -> str:
    return "-" if value is None else str(value)


def _percent(fraction: float | None) -> str:
    return "-" if fraction is None else f"{100 * fraction:.1f}"


# -- cache check ----------------------------------------------------------------------------
def cache_check(address: str | None, as_json: bool) -> int:
    try:
        connect(address)
    except NothingRunning as exc:
        print(f"kvserve: nothing deployed: {exc}", file=sys.stderr)
        return 1

    from kvserve.cluster import cache_check as check

    try:
        return check.run(APP_NAME, as_json)
    finally:
        local_head.disconnect_driver()


# -- down ----------------------------------------------------------------------------------
def down(address: str | None, state: local_head.UpState | None = None) -> int:
    """Delete the app, its cache manager and status rows; stop the head if kvserve started it
    (`state`: that deployment, else the one `_target` picks)."""
    try:
        target, state = connect(address, state)
    except NothingRunning as exc:
        print(f"kvserve: nothing running: {exc}", file=sys.stderr)
        return 1
    from ray import serve

    from kvserve.cache_manager import actor as cache_manager
    from kvserve.cluster import key_rings

    stop_head = state is not None and state.started_head
    try:
        deleted = APP_NAME in serve.status().applications
        if deleted:
            serve.delete(APP_NAME)
            print(f"kvserve: deleted the '{APP_NAME}' application", flush=True)
        replica_status.delete_all()
        key_rings.forget(APP_NAME)
        keys = cache_manager.shutdown(cache_manager.deployment_key(APP_NAME, "Generation"))
        if keys is not None:
            print(f"kvserve: stopped the cache manager, deleted its Redis keys ({keys})",
                  flush=True)
        if stop_head:
            serve.shutdown()  # before the head goes: nothing left to drain
    finally:
        local_head.disconnect_driver()
    if stop_head:
        start = time.monotonic()
        local_head.stop_head(state.head_pid, state.temp_dir, node_pids=state.node_pids)
        print(f"kvserve: stopped the Ray head at {target} that kvserve started "
              f"({time.monotonic() - start:.1f} s)", flush=True)
    recorded = local_head.read_state()
    if state is not None and recorded is not None and recorded.address == state.address:
        local_head.remove_state()
    if not deleted and not stop_head:
        print(f"kvserve: nothing running: no '{APP_NAME}' application on the Ray cluster at "
              f"{target}", file=sys.stderr)
        return 1
    return 0
