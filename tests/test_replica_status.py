"""The pure parts of per-replica status: serialisation, staleness filtering, the status table,
and the `kvserve up --detach` state file. (The Ray side is covered by test_cli_detached.py.)"""

from __future__ import annotations

import json

from kvserve.cli.status import format_status
from kvserve.cluster import local_head
from kvserve.cluster.replica_status import (
    STALE_AFTER_S,
    ReplicaStatus,
    StatusPublisher,
    current_rows,
    parse_rows,
)


def row(replica_id: str = "r1", updated_at: float = 1000.0, **kw) -> ReplicaStatus:
    values = {"pid": 42, "node_ip": "10.0.0.1", "running": 3, "waiting": 1,
              "kv_cache_usage": 0.25} | kw
    return ReplicaStatus(replica_id=replica_id, updated_at=updated_at, **values)


def test_json_round_trip_keeps_every_field():
    r = row(kv_cache_usage=0.125, rss_bytes=512 * 1024**2, node_id="n1", gpu_ids=["0"],
            device="cpu", kv_pool_bytes=64 * 1024**2, rank_pids=[43, 44])
    data = r.to_json()
    assert isinstance(data, bytes)
    assert ReplicaStatus.from_json(data) == r
    assert ReplicaStatus.from_json(data.decode()) == r
    assert set(json.loads(data)) == {"replica_id", "pid", "node_ip", "running", "waiting",
                                     "kv_cache_usage", "updated_at", "rss_bytes", "node_id",
                                     "gpu_ids", "device", "kv_pool_bytes", "rank_pids"}


def test_parse_rows_skips_missing_and_malformed_values():
    good = row("a")
    values = [good.to_json(), None, b"not json", b'{"replica_id": "x"}', b"[1, 2]",
              row("b").to_json()]
    assert [r.replica_id for r in parse_rows(values)] == ["a", "b"]


def test_stale_rows_are_dropped():
    now = 1000.0
    rows = [row("fresh", now - 0.5), row("edge", now - STALE_AFTER_S),
            row("stale", now - STALE_AFTER_S - 0.01), row("future", now + 1)]
    assert set(current_rows(rows, now=now)) == {"fresh", "edge", "future"}
    assert set(current_rows(rows, now=now, max_age=0.1)) == {"future"}


def test_rows_of_replicas_serve_no_longer_lists_are_dropped():
    rows = [row("live", 999.0), row("dead", 999.5)]
    assert set(current_rows(rows, now=1000.0, live_ids=["live", "other"])) == {"live"}
    assert current_rows(rows, now=1000.0, live_ids=[]) == {}
    assert set(current_rows(rows, now=1000.0)) == {"live", "dead"}  # no Serve list: keep all


def test_newest_row_of_a_replica_wins():
    rows = [row("a", 999.0, running=1), row("a", 999.9, running=7), row("a", 999.5, running=2)]
    assert current_rows(rows, now=1000.0)["a"].running == 7


def test_publisher_snapshot_becomes_a_row():
    state = {"running": 2, "waiting": 5, "usage": 0.5}
    pub = StatusPublisher(lambda: (state["running"], state["waiting"], state["usage"]),
                          replica_id="abc", node_ip="1.2.3.4")
    first = pub.current()
    assert (first.replica_id, first.node_ip, first.running, first.waiting,
            first.kv_cache_usage) == ("abc", "1.2.3.4", 2, 5, 0.5)
    assert first.pid > 0 and first.updated_at > 0
    state["running"] = 0
    assert pub.current().running == 0


def test_publisher_carries_the_engines_kv_pool_bytes_apart_for_the_soak():
    """An engine's `EngineLoad` carries the KV pool's pages in RAM; the row keeps them apart
    from the RSS, and the soak's watch takes them out of it."""
    from kvserve.cluster.memory_watch import watched_bytes
    from kvserve.workers.engine import EngineLoad

    pub = StatusPublisher(lambda: EngineLoad(1, 0, 0.5, 48 * 1024**2), replica_id="abc",
                          node_ip="1.2.3.4")
    current = pub.current()
    assert current.kv_pool_bytes == 48 * 1024**2 and current.rss_bytes > 0
    assert watched_bytes(current) == current.rss_bytes - 48 * 1024**2


def test_publisher_survives_a_failing_store_warning_once_then_publishes_again(monkeypatch,
                                                                              caplog):
    """Status is best effort: a failing store never raises into the replica, warns once (not
    once per interval), and the next publish after the store is back writes the row."""
    import kvserve.cluster.replica_status as rs

    stored: list[ReplicaStatus] = []
    attempts = []

    def store(row: ReplicaStatus) -> None:
        attempts.append(row)
        if len(attempts) <= 3:
            raise ConnectionError("GCS is down")
        stored.append(row)

    monkeypatch.setattr(rs, "put", store)
    pub = StatusPublisher(lambda: (1, 2, 0.5), replica_id="x", node_ip="127.0.0.1")
    with caplog.at_level("WARNING", logger=rs.__name__):
        for _ in range(4):
            pub.publish_once()
    assert len(attempts) == 4  # every publish tried the store
    warnings = [r for r in caplog.records if "could not publish" in r.getMessage()]
    assert len(warnings) == 1 and warnings[0].exc_info is not None
    assert [(r.replica_id, r.running, r.waiting) for r in stored] == [("x", 1, 2)]


def test_status_table_shows_every_replica_and_dashes_for_missing_rows():
    report = {
        "application": "kvserve", "status": "RUNNING", "message": "", "grpc_port": 50051,
        "ray_address": "127.0.0.1:6379",
        "deployments": {"Generation": {"status": "HEALTHY", "message": "", "target_replicas": 2,
                                       "replica_states": {"RUNNING": 2}}},
        "replicas": [
            {"replica_id": "aaaa", "deployment": "Generation", "state": "RUNNING", "pid": 11,
             "node_ip": "x", "node_id": "0f3a9c1e77d2", "gpu_ids": ["0"],
             "running": 3, "waiting": 0, "kv_cache_usage": 0.1234,
             "updated_at": 1.0, "kv_host_usage": 0.5, "kv_cached_blocks": 7,
             "prefix_cache_hit_rate": 0.921, "rss_mib": 905, "rank_pids": [21, 22]},
            {"replica_id": "bbbb", "deployment": "Generation", "state": "RUNNING", "pid": 12,
             "node_ip": "x", "running": None, "waiting": None, "kv_cache_usage": None,
             "updated_at": None},
        ],
    }
    text = format_status(report)
    assert "application kvserve: RUNNING" in text
    assert "deployment Generation: HEALTHY (RUNNING=2; target 2)" in text
    lines = text.splitlines()
    header = next(line for line in lines if line.startswith("REPLICA"))
    assert header.split() == ["REPLICA", "PID", "TP", "RANK", "PIDS", "NODE", "GPU", "STATE",
                              "RUNNING", "WAITING", "KV", "%", "HOST", "KV", "%", "CACHED",
                              "PREFIX", "HIT", "%", "RSS", "MiB"]
    a = next(line for line in lines if line.startswith("aaaa")).split()
    b = next(line for line in lines if line.startswith("bbbb")).split()
    assert a == ["aaaa", "11", "1:21,2:22", "0f3a9c1e", "0", "RUNNING", "3", "0", "12.3",
                 "50.0", "7", "92.1", "905"]
    assert b == ["bbbb", "12", "-", "-", "-", "RUNNING", "-", "-", "-", "-", "-", "-", "-"]


def test_up_state_file_round_trip(tmp_path, monkeypatch):
    monkeypatch.setenv("KVSERVE_CACHE_DIR", str(tmp_path / "cache"))
    assert local_head.read_state() is None
    state = local_head.UpState(address="127.0.0.1:1234", started_head=True, grpc_port=50051,
                               head_pid=2**22 + 1, temp_dir="/tmp/kvserve-ray-x",
                               env={"RAY_AUTH_MODE": "token"})
    local_head.write_state(state)
    assert local_head.state_path() == tmp_path / "cache" / "up.json"
    assert local_head.read_state() == state
    assert not state.head_alive()  # no such process
    local_head.state_path().write_text("{broken")
    assert local_head.read_state() is None
    local_head.remove_state()
    local_head.remove_state()  # idempotent
    assert local_head.read_state() is None
