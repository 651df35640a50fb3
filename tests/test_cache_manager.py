"""The cache manager's logic against a real Redis server: it asks for full reports whenever Redis
may have lost the replica's state, full reports rebuild it, and `check` names every difference."""

from __future__ import annotations

import pytest

from kvserve.cache_manager.index import KVIndex, ReplicaReport, ReplicaUsage
from kvserve.cache_manager.manager import CacheManager, ReplicaState
from kvserve.cache_manager.redis_server import connect

USAGE = ReplicaUsage(100, 4, 2, block_size=16)


@pytest.fixture
def redis_handle(tmp_path):
    handle = connect(data_dir=tmp_path / "redis")
    yield handle
    handle.close()


def delta(stored=(), removed=(), requests=None) -> ReplicaReport:
    return ReplicaReport("r1", USAGE, {"device": list(stored)}, {"device": list(removed)},
                         requests)


def full(*hashes: str, requests=None) -> ReplicaReport:
    return ReplicaReport("r1", USAGE, {"device": list(hashes)}, requests=requests or {},
                         full=True)


def state(*hashes: str, requests=None) -> ReplicaState:
    return ReplicaState("r1", list(hashes), [], requests or {})


def test_a_new_manager_asks_for_a_full_report_then_takes_deltas(redis_handle):
    manager = CacheManager(KVIndex(redis_handle.client, "d"))
    assert manager.report(delta(stored=["aa"]))  # never saw r1: wants everything
    assert not manager.report(full("aa", "bb", requests={"q": 2}))
    assert not manager.report(delta(stored=["cc"], removed=["aa"]))
    assert manager.check([state("bb", "cc", requests={"q": 2})]) == []
    assert manager.block_size == 16

    restarted = CacheManager(KVIndex(redis_handle.client, "d"))  # same Redis, no memory
    assert restarted.report(delta(stored=["dd"]))
    assert not restarted.report(full("bb", "cc", "dd", requests={"q": 2}))
    assert restarted.check([state("bb", "cc", "dd", requests={"q": 2})]) == []


def test_an_emptied_redis_is_noticed_and_rebuilt_from_a_full_report(redis_handle):
    manager = CacheManager(KVIndex(redis_handle.client, "d"))
    manager.report(full("aa", "bb"))
    redis_handle.client.flushall()  # what a Redis restart without persistence leaves
    assert manager.report(delta(stored=["cc"]))  # the delta landed on nothing: want a full one
    assert manager.check([state("aa", "bb", "cc")]) != []
    assert not manager.report(full("aa", "bb", "cc"))
    assert manager.check([state("aa", "bb", "cc")]) == []


def test_check_names_each_difference(redis_handle):
    manager = CacheManager(KVIndex(redis_handle.client, "d"))
    manager.report(full("aa", "bb", requests={"q": 1}))
    problems = manager.check([state("bb", "cc", requests={"q": 1, "z": 3}),
                              ReplicaState("r9", [], [], {})])
    assert problems == [
        "replica r9: running but missing from Redis",
        "replica r1 device block cc: held by the worker, missing from Redis",
        "replica r1 device block aa: in Redis, not held by the worker",
        "replica r1 request z: held by the worker, missing from Redis",
    ]
    assert manager.check([]) == ["replica r1: in Redis but not running"]


def test_redis_down_means_route_on_load_and_resend_everything(redis_handle):
    manager = CacheManager(KVIndex(redis_handle.client, "d"))
    manager.report(full("aa"))
    redis_handle.stop_server()
    assert manager.report(delta(stored=["bb"]))  # failed write: full report next time
    assert manager.match(["aa"]) == {}
