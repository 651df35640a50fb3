"""The KV cache through Ray Serve's gRPC proxy, with real Ray, real Redis and the real model:
cache-aware routing keeps multi-turn chats on the replica holding their history (and with it
off, the same scenario misses), and the cache manager's Redis index matches what the workers
hold, also after a replica that is streaming is killed and Redis and the manager restart."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest
import ray

from kvserve.cache_manager import actor as cache_manager
from kvserve.cache_manager.redis_server import start_embedded
from kvserve.cluster.cache_check import find_problems
from kvserve.v1 import generation_pb2 as pb
from tests.helpers import poll, solo_ids_each
from tests.serving import TWO_REPLICAS, Served, serve_locally
from tests.test_serve_replica_kill import _replica_rows, _replica_states

pytestmark = pytest.mark.ray  # starts Ray, so also slow (tests/suite_plugin.py)
USES_SHARED_RAY = "3a"  # tests/serving.py: run with the modules of this group

HIT_RATE = 0.9  # of later turns' prompt tokens found cached, with routing
PLACES = ["Lisbon", "Oslo", "Quito", "Hanoi", "Accra", "Perth", "Lima", "Riga"]


def document(i: int) -> str:
    place = PLACES[i]
    lines = [f"Entry {j} of the {place} harbour log: ship {100 * i + j} arrived at berth "
             f"{j % 7 + 1} carrying {12 * j + i} crates of {['tea', 'salt', 'wool'][j % 3]}."
             for j in range(16)]
    return f"You answer questions about the {place} harbour log below.\n" + "\n".join(lines)


def chat_turn(served: Served, doc: str, history: list, question: str) -> tuple[str, pb.Usage]:
    messages = [pb.ChatMessage(role="system", content=doc), *history,
                pb.ChatMessage(role="user", content=question)]
    request = pb.GenerateRequest(messages=pb.ChatMessages(messages=messages),
                                 params=pb.SamplingParams(temperature=0, max_tokens=8))
    responses = list(served.stub.Generate(request, metadata=served.metadata))
    return "".join(r.text for r in responses), responses[-1].usage


def conversations(served: Served, count: int = 8, turns: int = 5) -> list[list[pb.Usage]]:
    """`count` chats advancing in rounds: each round sends every chat's next turn at once.
    (Chats that each wait for their own previous turn would stick to one replica under plain
    least-loaded routing too: the replica that just answered is the less loaded one.)"""
    histories: list[list] = [[] for _ in range(count)]
    usages: list[list[pb.Usage]] = [[] for _ in range(count)]

    def turn(i: int, t: int) -> None:
        question = f"Question {t}: which ship arrived at berth {t + 1}?"
        answer, usage = chat_turn(served, document(i), histories[i], question)
        usages[i].append(usage)
        histories[i] += [pb.ChatMessage(role="user", content=question),
                         pb.ChatMessage(role="assistant", content=answer)]

    with ThreadPoolExecutor(count) as pool:
        for t in range(turns):
            list(pool.map(lambda i, t=t: turn(i, t), range(count)))
    return usages


def cache_check(served) -> list[str]:
    """What `kvserve cache check` prints: every difference between Redis and the workers."""
    return find_problems(served.handle, cache_manager.get(served.manager_key))


def test_kv_cache_metrics_reach_prometheus_under_memory_pressure():
    """A device pool too small for the batch: requests are swapped to the host tier, cached
    prefixes demoted there and restored; every KV cache metric shows it."""
    from kvserve.cluster.metrics import KV_CACHE_METRIC_NAMES
    from tests.test_serve_app import _nonzero

    # 19-21 tokens each: one full, cacheable block of prompt; 6 x (prompt + 48) tokens need
    # 30 blocks of 16 tokens, the 16 MiB pool holds 22, so the batch is swapped out
    prompts = [document(i).split("\n")[0] + f" Now list ten ships from log {i}." for i in range(6)]
    # 311 tokens, 20 blocks: allocating them evicts all but ~2 of the 22 blocks, so the
    # prompts' cached blocks are demoted to the host tier whatever order round 1 ended in
    flush = "\n".join(document(6).split("\n")[:11])
    app = {"replicas": 1, "kv_cache_memory": "16MiB", "cpu_offload_memory": "96MiB"}
    with serve_locally(app) as served:
        for round_ in range(2):  # the second round finds its prompts on the host tier
            with ThreadPoolExecutor(len(prompts)) as pool:
                list(pool.map(lambda p: served.stream(p, max_tokens=48, ignore_eos=True),
                              prompts))
            if round_ == 0:
                served.stream(flush, max_tokens=1)
        stats = served.handle.kv_stats.remote().result()
        assert stats["blocks_swapped_out"] > 0 and stats["blocks_restored"] > 0, stats
        deadline, missing = time.monotonic() + 30, list(KV_CACHE_METRIC_NAMES)
        while missing and time.monotonic() < deadline:
            time.sleep(1)
            families = served.metrics()
            missing = [m for m in KV_CACHE_METRIC_NAMES if not _nonzero(families, m)]
        assert not missing, f"metrics absent or zero: {missing}"


def test_chaos_leaves_an_exact_index_no_leaks_and_no_crossed_outputs(real_engine, tmp_path):
    """While clients stream, SIGKILL a replica that is streaming, restart Redis
    (empty), restart the manager actor; then `cache check` finds nothing, no KV block is leaked,
    every request that finished got exactly its own solo output, at least one stream was cut
    by the kill, and at least 4 requests (as many as there are clients) sent after the chaos
    ended finished exactly."""
    redis = start_embedded(tmp_path / "redis")  # an external Redis (REDIS_URL) we can restart
    shared = document(0)
    prompts = [f"{shared}\nQuestion {i}: what did ship {i} carry?" for i in range(10)]
    # 48 tokens: a stream that has some tokens still has 16 or more to come for a while
    params = {"temperature": 0, "max_tokens": 48, "ignore_eos": True}
    expected = solo_ids_each(real_engine, [{"prompt": p, "params": params} for p in prompts])
    # max_expected_wait_s: not a test of admission (as TWO_REPLICAS): while the killed replica
    # is replaced, the other serves all four clients, and on a loaded CI machine (three xdist
    # workers) its expected wait can pass the default 30 s, refusing a client
    app = {"replicas": 2, "num_cpus_per_replica": 1, "kv_cache_memory": "64MiB",
           "cpu_offload_memory": "32MiB", "redis_url": redis.url, "kv_lease_ttl_s": 3.0,
           "max_expected_wait_s": 600}
    try:
        with serve_locally(app) as served:
            traffic = _Traffic(served, prompts, params)
            with traffic.running():
                redis, began, ended = _chaos(served, redis, traffic)
                after = traffic.wait_for(lambda r: r.sent_at > ended and r.error is None, 4,
                                         timeout_s=300)
            results = traffic.results
            assert all(r.ids == expected[r.index] for r in results if r.error is None)
            assert {r.error for r in results} <= {None, "UNAVAILABLE"}, results
            cut = [r for r in results if r.request_id in traffic.killed_streams]
            assert cut and all(r.error == "UNAVAILABLE" and r.tokens > 0
                               and r.sent_at < began < r.ended_at for r in cut), cut
            assert len(after) >= 4, f"{len(after)} requests finished after the chaos"
            _wait_for_running_replicas(served, 2)
            manager = cache_manager.get(served.manager_key)
            assert find_problems(served.handle, manager, attempts=30) == []
            for stats in served.handle.broadcast("kv_stats").results():
                assert stats["device_used"] == 0, stats  # every block free or cached
                assert stats["host_used"] == stats["host_cached"], stats  # nothing swapped
            manager_stats = ray.get(cache_manager.get(served.manager_key).stats.remote())
            assert manager_stats["full_reports"] >= 2  # the restarted manager rebuilt Redis
    finally:
        redis.close()


# the routed run last: it leaves the 2-replica deployment that test_serve_two_replicas and
# test_serve_replica_kill (run next, tests/suite_plugin.py) reuse
@pytest.mark.parametrize("routed", [False, True], ids=["unrouted", "routed"])
def test_multi_turn_chats_stay_on_the_replica_holding_their_history(routed):
    """8 conversations x 5 turns over 2 replicas; every later turn finds its
    history cached (so it was routed to its holder) and turns 2-5 hit > 90% of prompt tokens.

    Negative control: with cache-aware routing off, Serve's own (load-based) router sends turns
    to either replica, and the same thresholds fail: measured by hand on this machine, the
    unrouted rate is about 0.5-0.7 and several turns find none of their history. The control
    runs 3 turns, not 5: its 16 later turns already miss (and it pays a deployment of its own)."""
    app = TWO_REPLICAS if routed else {**TWO_REPLICAS, "cache_aware_routing": False}
    with serve_locally(app, reuse=routed) as served:
        chats = conversations(served, turns=5 if routed else 3)
        later = [(i, turn, usage) for i, usages in enumerate(chats)
                 for turn, usage in enumerate(usages[1:], start=2)]
        missed = [(i, turn, u) for i, turn, u in later
                  if not u.cached_tokens > 0.8 * u.prompt_tokens]
        rate = sum(u.cached_tokens for *_, u in later) / sum(u.prompt_tokens for *_, u in later)
        assert cache_check(served) == []  # routing or not, Redis matches the workers
    if routed:
        assert missed == [], missed
        assert rate > HIT_RATE, rate
    else:
        assert missed and rate < HIT_RATE, (rate, missed)


@dataclass
class _Request:
    index: int  # into the prompts
    sent_at: float  # time.monotonic() when the client sent it
    request_id: str = ""  # sent with it: the engine on the replica knows it by this id
    ended_at: float = 0.0
    tokens: int = 0  # token ids received
    ids: list[int] = field(default_factory=list)
    error: str | None = None  # the gRPC status name, None if it finished


class _Traffic:
    """4 clients streaming the prompts in turn, each sending its next request when the last
    ends; every request's timing and outcome is kept."""

    def __init__(self, served, prompts: list[str], params: dict) -> None:
        self.served, self.prompts, self.params = served, prompts, params
        self.results: list[_Request] = []
        self.in_flight: dict[str, _Request] = {}  # request id -> a request not yet ended
        self.killed_streams: set[str] = set()  # ids of the streams running where _chaos killed
        self.stop = threading.Event()

    def _client(self, k: int) -> None:
        i = k
        while not self.stop.is_set():
            r = _Request(i % len(self.prompts), time.monotonic(), f"chaos-{i}")
            self.in_flight[r.request_id] = r
            request = pb.GenerateRequest(request_id=r.request_id, prompt=self.prompts[r.index],
                                         params=pb.SamplingParams(**self.params))
            try:
                for response in self.served.stub.Generate(request, metadata=self.served.metadata,
                                                          timeout=120):
                    r.ids += response.token_ids
                    r.tokens = len(r.ids)
            except grpc.RpcError as exc:
                r.error = exc.code().name
            r.ended_at = time.monotonic()
            self.results.append(r)
            del self.in_flight[r.request_id]
            i += 4

    @contextlib.contextmanager
    def running(self) -> Iterator[None]:
        with ThreadPoolExecutor(4) as pool:
            clients = [pool.submit(self._client, k) for k in range(4)]
            try:
                yield
            finally:
                self.stop.set()
            for c in clients:
                c.result()

    def wait_for(self, which: Callable[[_Request], bool], count: int,
                 timeout_s: float = 120) -> list[_Request]:
        """The requests `which` selects, once `count` of them have ended (or at the timeout)."""
        return poll(lambda: [r for r in list(self.results) if which(r)],
                    lambda found: len(found) >= count, timeout_s, 0.1)


def _chaos(served, redis, traffic: _Traffic):
    """Kill a replica while it streams, restart Redis empty, restart the cache manager; between
    steps, wait until traffic has moved on (two more requests ended), not for fixed times.
    Returns the new Redis handle and when the chaos began and ended."""

    def two_more() -> None:
        seen = len(traffic.results)
        traffic.wait_for(lambda r: True, seen + 2, timeout_s=120)

    traffic.wait_for(lambda r: r.error is None, 4)  # both replicas warm, prefixes cached
    victim = poll(lambda: _streaming_replica(served, traffic), bool, 60, 0.05)
    assert victim, "no replica held a stream that had tokens and many more to come"
    pid, streams = victim
    began = time.monotonic()
    os.kill(pid, signal.SIGKILL)
    traffic.killed_streams = streams
    two_more()
    data_dir = Path(redis.url.removeprefix("unix://")).parent
    redis.stop_server()
    redis = start_embedded(data_dir)  # the same address, empty
    two_more()
    ray.kill(cache_manager.get(served.manager_key), no_restart=False)  # Ray restarts it
    two_more()
    return redis, began, time.monotonic()


def _streaming_replica(served, traffic: _Traffic) -> tuple[int, set[str]] | None:
    """The pid of a replica running streams this test's clients are receiving, each with at
    least 16 tokens still to come (the kill lands long before they could end), and their ids;
    None if there is none at this moment. Asking the replicas which requests they run, rather
    than reading their `running` counts, never picks a replica that has just gone idle (and
    cache-aware routing may well send every client to the replica holding the prefix)."""
    pids = {row["replica_id"]: row["pid"] for row in _replica_rows(served.handle, timeout=5)}
    states = served.handle.broadcast("kv_state").results(timeout_s=5, return_exceptions=True)
    # after the replicas answered: a stream they held that is still running now is still there
    budget = traffic.params["max_tokens"] - 16
    live = {rid for rid, r in list(traffic.in_flight.items()) if 0 < r.tokens <= budget}
    held = [(len(found), state.replica_id, found) for state in states
            if not isinstance(state, BaseException) and state.replica_id in pids
            and (found := live & set(state.requests))]
    if not held:
        return None
    _, replica_id, found = max(held)
    return pids[replica_id], found


def _wait_for_running_replicas(served: Served, count: int, timeout: float = 120) -> None:
    states = poll(lambda: _replica_states(served.app), lambda s: s == {"RUNNING": count},
                  timeout, 1.0)
    assert states == {"RUNNING": count}, states


def test_the_cache_manager_answers_a_router_while_it_writes_a_big_report():
    """A router's `match` runs on the manager's own routing thread, not after the reports
    queued before it: while a report of 200k block hashes is written to Redis (hundreds of ms
    here), a match sent after it comes back first. Negative control: with one thread for
    every call (no concurrency groups) the report finishes first."""
    from kvserve.cache_manager.index import ReplicaReport, ReplicaUsage

    with serve_locally(TWO_REPLICAS, reuse=True):  # on the shared cluster; its app is not used
        name = f"routing-thread-{os.getpid()}-{time.monotonic_ns()}"
        manager = cache_manager.get_or_start(name)
        try:
            assert ray.get(manager.block_size.remote(), timeout=60) is None  # started
            hashes = [f"{i:064x}" for i in range(200_000)]
            big = ReplicaReport("replica-a", ReplicaUsage(len(hashes), 0, len(hashes),
                                                          block_size=16),
                                stored={"device": hashes}, full=True)
            report = manager.report.remote(big)
            match = manager.match.remote(hashes[:4])
            ready, _ = ray.wait([report, match], num_returns=1, timeout=120)
            assert ready == [match], "the match waited for the report"
            assert ray.get(report, timeout=120) is False  # a full report: no full one asked
            assert ray.get(manager.match.remote(hashes[:4]), timeout=60) == {"replica-a": 4}
        finally:
            cache_manager.shutdown(name)
