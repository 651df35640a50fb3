"""Issue #4 through Ray Serve's gRPC proxy, with real Ray, real Redis and the real model:
cache-aware routing keeps multi-turn chats on the replica holding their history, and the
cache manager's Redis index matches what the workers hold."""

from __future__ import annotations

import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest
import ray

from cache_manager import actor as cache_manager
from cache_manager.redis_server import start_embedded
from cluster.cache_check import find_problems
from kvserve.v1 import generation_pb2 as pb
from tests.helpers import poll, solo_ids
from tests.serving import APP, METADATA, serve_locally
from tests.test_serve_replica_kill import _replica_rows, _replica_states

pytestmark = pytest.mark.ray  # starts Ray, so also slow (tests/conftest.py)

MANAGER_KEY = cache_manager.deployment_key(APP, "Generation")
PLACES = ["Lisbon", "Oslo", "Quito", "Hanoi", "Accra", "Perth", "Lima", "Riga"]


def document(i: int) -> str:
    place = PLACES[i]
    lines = [f"Entry {j} of the {place} harbour log: ship {100 * i + j} arrived at berth "
             f"{j % 7 + 1} carrying {12 * j + i} crates of {['tea', 'salt', 'wool'][j % 3]}."
             for j in range(16)]
    return f"You answer questions about the {place} harbour log below.\n" + "\n".join(lines)


def chat_turn(stub, doc: str, history: list, question: str) -> tuple[str, pb.Usage]:
    messages = [pb.ChatMessage(role="system", content=doc), *history,
                pb.ChatMessage(role="user", content=question)]
    request = pb.GenerateRequest(messages=pb.ChatMessages(messages=messages),
                                 params=pb.SamplingParams(temperature=0, max_tokens=8))
    responses = list(stub.Generate(request, metadata=METADATA))
    return "".join(r.text for r in responses), responses[-1].usage


def conversations(stub, count: int = 8, turns: int = 5) -> list[list[pb.Usage]]:
    """`count` chats advancing in rounds: each round sends every chat's next turn at once.
    (Chats that each wait for their own previous turn would stick to one replica under plain
    least-loaded routing too: the replica that just answered is the less loaded one.)"""
    histories: list[list] = [[] for _ in range(count)]
    usages: list[list[pb.Usage]] = [[] for _ in range(count)]

    def turn(i: int, t: int) -> None:
        question = f"Question {t}: which ship arrived at berth {t + 1}?"
        answer, usage = chat_turn(stub, document(i), histories[i], question)
        usages[i].append(usage)
        histories[i] += [pb.ChatMessage(role="user", content=question),
                         pb.ChatMessage(role="assistant", content=answer)]

    with ThreadPoolExecutor(count) as pool:
        for t in range(turns):
            list(pool.map(lambda i, t=t: turn(i, t), range(count)))
    return usages


def cache_check(served) -> list[str]:
    """What `kvserve cache check` prints: every difference between Redis and the workers."""
    return find_problems(served.handle, cache_manager.get(MANAGER_KEY))


def test_multi_turn_chats_stay_on_the_replica_holding_their_history():
    """Acceptance 4: 8 conversations x 5 turns over 2 replicas; every later turn finds its
    history cached (so it was routed to its holder) and turns 2-5 hit > 90% of prompt tokens."""
    app = {"replicas": 2, "kv_cache_memory": "256MiB", "num_cpus_per_replica": 1}
    with serve_locally(app) as served:
        chats = conversations(served.stub)
        later = [u for usages in chats for u in usages[1:]]
        for i, usages in enumerate(chats):
            for turn, usage in enumerate(usages[1:], start=2):
                assert usage.cached_tokens > 0.8 * usage.prompt_tokens, (i, turn, usage)
        rate = sum(u.cached_tokens for u in later) / sum(u.prompt_tokens for u in later)
        assert rate > 0.9, rate
        assert cache_check(served) == []


def test_chaos_leaves_an_exact_index_no_leaks_and_no_crossed_outputs(real_engine, tmp_path):
    """Acceptance 5: while clients stream, SIGKILL a replica, restart Redis (empty), restart the
    manager actor; then `cache check` finds nothing, no KV block is leaked, and every request that
    finished got exactly its own solo output."""
    redis = start_embedded(tmp_path / "redis")  # an external Redis (REDIS_URL) we can restart
    shared = document(0)
    prompts = [f"{shared}\nQuestion {i}: what did ship {i} carry?" for i in range(10)]
    params = {"temperature": 0, "max_tokens": 16}
    expected = [solo_ids(real_engine, prompt=p, params=params) for p in prompts]
    app = {"replicas": 2, "num_cpus_per_replica": 1, "kv_cache_memory": "64MiB",
           "cpu_offload_memory": "32MiB", "redis_url": redis.url, "kv_lease_ttl_s": 3.0}
    try:
        with serve_locally(app) as served:
            outcomes = _stream_through_chaos(served, prompts, params, lambda: _chaos(served, redis))
            redis = outcomes.pop("redis")
            ok = [(i, ids) for i, ids in outcomes["done"]]
            assert len(ok) >= 10 and all(ids == expected[i] for i, ids in ok)
            assert set(outcomes["errors"]) <= {"UNAVAILABLE"}, outcomes["errors"]
            _wait_for_running_replicas(2)
            assert find_problems(served.handle, cache_manager.get(MANAGER_KEY), attempts=30) == []
            for stats in served.handle.broadcast("kv_stats").results():
                assert stats["device_used"] == 0, stats  # every block free or cached
                assert stats["host_used"] == stats["host_cached"], stats  # nothing swapped
            manager_stats = ray.get(cache_manager.get(MANAGER_KEY).stats.remote())
            assert manager_stats["full_reports"] >= 2  # the restarted manager rebuilt Redis
    finally:
        redis.close()


def _stream_through_chaos(served, prompts, params, chaos) -> dict:
    done, errors, stop = [], [], threading.Event()

    def client(k: int) -> None:
        i = k
        while not stop.is_set():
            request = pb.GenerateRequest(prompt=prompts[i % len(prompts)],
                                         params=pb.SamplingParams(**params))
            try:
                ids = [t for r in served.stub.Generate(request, metadata=METADATA, timeout=120)
                       for t in r.token_ids]
                done.append((i % len(prompts), ids))
            except grpc.RpcError as exc:
                errors.append(exc.code().name)
            i += 4

    with ThreadPoolExecutor(4) as pool:
        clients = [pool.submit(client, k) for k in range(4)]
        try:
            redis = chaos()
        finally:
            stop.set()
        for c in clients:
            c.result()
    return {"done": done, "errors": errors, "redis": redis}


def _chaos(served, redis):
    time.sleep(4)
    busy = [r for r in _replica_rows(served.handle) if r["running"] > 0]
    os.kill((busy or _replica_rows(served.handle))[0]["pid"], signal.SIGKILL)
    time.sleep(2)
    data_dir = Path(redis.url.removeprefix("unix://")).parent
    redis.stop_server()
    redis = start_embedded(data_dir)  # the same address, empty
    time.sleep(2)
    ray.kill(cache_manager.get(MANAGER_KEY), no_restart=False)  # Ray restarts it
    time.sleep(4)
    return redis


def _wait_for_running_replicas(count: int, timeout: float = 120) -> None:
    states = poll(_replica_states, lambda s: s == {"RUNNING": count}, timeout, 1.0)
    assert states == {"RUNNING": count}, states


def test_kv_cache_metrics_reach_prometheus_under_memory_pressure():
    """A device pool too small for the batch: requests are swapped to the host tier, cached
    prefixes demoted there and restored; every KV cache metric shows it."""
    from cluster.metrics import KV_CACHE_METRIC_NAMES
    from tests.test_serve_app import _nonzero

    prompts = [document(i).split("\n")[0] + f" Now list ten ships from log {i}." for i in range(6)]
    app = {"replicas": 1, "kv_cache_memory": "24MiB", "cpu_offload_memory": "96MiB"}
    with serve_locally(app) as served:
        for _ in range(2):  # the second round finds its prompts demoted to the host tier
            with ThreadPoolExecutor(len(prompts)) as pool:
                list(pool.map(lambda p: served.stream(p, max_tokens=96, ignore_eos=True),
                              prompts))
        stats = served.handle.kv_stats.remote().result()
        assert stats["blocks_swapped_out"] > 0 and stats["blocks_restored"] > 0, stats
        deadline, missing = time.monotonic() + 30, list(KV_CACHE_METRIC_NAMES)
        while missing and time.monotonic() < deadline:
            time.sleep(1)
            families = served.metrics()
            missing = [m for m in KV_CACHE_METRIC_NAMES if not _nonzero(families, m)]
        assert not missing, f"metrics absent or zero: {missing}"
