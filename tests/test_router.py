"""The cache-aware request router (kvserve/cluster/router.py): the ranking rule, prompt -> block
hashes
as the engine computes them, and Serve's routing loop driving the router over fake replicas and
a fake cache manager, including a missing, slow or dying manager. No Ray cluster is started."""

from __future__ import annotations

import asyncio
import inspect
import math
import pickle
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import pytest
from ray.serve.config import RequestRouterConfig
from ray.serve.request_router import PendingRequest, ReplicaID

import kvserve.cluster.router as router_mod
from kvserve.cluster.ray_compat import (
    deployment_id,
    grpc_request,
    new_request_router,
    request_metadata,
    route_request,
)
from kvserve.cluster.router import (
    CacheAwareRouter,
    block_hashes_hex,
    choose_replica_ids,
    generate_request_of,
    prompt_token_ids,
    request_router_config,
)
from kvserve.v1 import generation_pb2 as pb
from kvserve.workers.core.inputs import to_token_ids
from kvserve.workers.core.prefix_hash import block_hash

BS = 4  # block size in the fake cluster
DEPLOYMENT = deployment_id("default", "Generation")
LOAD_TOKENIZER = router_mod._load_tokenizer  # the real one, before any test patches it


# -- the ranking rule --------------------------------------------------------------------------
def test_longest_prefix_wins():
    load = {"a": 0.0, "b": 2.0, "c": 0.0}
    assert choose_replica_ids({"a": 2, "b": 5}, load)[0] == "b"


def test_overloaded_holder_loses_to_the_least_loaded():
    order = choose_replica_ids({"a": 9}, {"a": 20.0, "b": 3.0}, imbalance_threshold=8)
    assert order == ["b", "a"]


def test_holder_at_exactly_the_threshold_is_not_overloaded():
    assert choose_replica_ids({"a": 1}, {"a": 11.0, "b": 3.0}, imbalance_threshold=8)[0] == "a"


def test_a_holder_that_admits_no_more_loses_however_small_the_imbalance():
    """A replica holding `capacity` requests (max_num_seqs running + as many waiting) refuses
    the next at once: a warm cache there is worth nothing. Below it, the holder still wins."""
    load = {"a": 4.0, "b": 1.0}
    assert choose_replica_ids({"a": 9}, load, imbalance_threshold=8, capacity=4) == ["b", "a"]
    assert choose_replica_ids({"a": 9}, load, imbalance_threshold=8, capacity=5)[0] == "a"
    assert choose_replica_ids({"a": 9}, load, imbalance_threshold=8)[0] == "a"  # no bound
    both_full = {"a": 4.0, "b": 5.0}  # no one admits: least loaded first, as with no holder
    assert choose_replica_ids({"b": 9}, both_full, capacity=4) == ["a", "b"]


def test_the_deployment_tells_the_router_what_a_replica_admits():
    from kvserve.cluster.app import AppConfig, routing

    def capacity(**engine) -> int:
        return routing(AppConfig(**engine)).request_router_kwargs["replica_capacity"]

    assert capacity(max_num_seqs=2) == 4  # max_waiting_requests defaults to max_num_seqs
    assert capacity(max_num_seqs=2, max_waiting_requests=6) == 8
    assert routing(AppConfig(cache_aware_routing=False)) is None


def test_equal_matches_go_to_the_less_loaded():
    assert choose_replica_ids({"a": 3, "b": 3}, {"a": 2.0, "b": 1.0, "c": 0.0})[0] == "b"


def test_no_match_ranks_least_loaded_first():
    assert choose_replica_ids({}, {"a": 3.0, "b": 1.0, "c": 2.0}) == ["b", "c", "a"]


def test_below_min_matched_blocks_is_no_match():
    load = {"a": 1.0, "b": 0.0}
    assert choose_replica_ids({"a": 1}, load, min_matched_blocks=2) == ["b", "a"]
    assert choose_replica_ids({"a": 2}, load, min_matched_blocks=2) == ["a", "b"]


def test_a_shorter_holder_within_the_threshold_beats_a_cold_least_loaded():
    order = choose_replica_ids({"a": 9, "b": 4}, {"a": 30.0, "b": 5.0, "c": 0.0},
                               imbalance_threshold=8)
    assert order == ["b", "c", "a"]


def test_every_candidate_is_ranked_once_and_full_ties_keep_the_given_order():
    assert choose_replica_ids({}, {"x": 1.0, "y": 1.0, "z": 1.0}) == ["x", "y", "z"]
    order = choose_replica_ids({"z": 1}, {"x": 0.0, "y": 4.0, "z": 2.0})
    assert order == ["z", "x", "y"]
    assert choose_replica_ids({"a": 1}, {}) == []


def test_unknown_load_counts_as_overloaded():
    assert choose_replica_ids({"a": 5}, {"a": math.inf, "b": 7.0})[0] == "b"
    assert choose_replica_ids({"a": 5}, {"a": math.inf, "b": math.inf})[0] == "a"


# -- prompt -> block hashes --------------------------------------------------------------------
def chained(token_ids: list[int], size: int, salt: str) -> list[str]:
    out: list[bytes] = []
    for i in range((len(token_ids) - 1) // size):
        out.append(block_hash(out[-1] if out else None, token_ids[i * size:(i + 1) * size], salt))
    return [h.hex() for h in out]


@pytest.mark.parametrize("n", [1, 4, 5, 8, 9, 33])
def test_token_id_hashes_are_the_chained_prefix_hashes_without_the_last_token(n):
    ids = list(range(100, 100 + n))
    assert block_hashes_hex(ids, BS, "salt") == chained(ids, BS, "salt")
    assert len(block_hashes_hex(ids, BS, "")) == (n - 1) // BS


def test_token_id_request_hashes_use_the_cache_salt():
    request = pb.GenerateRequest(prompt_token_ids=pb.TokenIds(ids=list(range(9))),
                                 cache_salt="tenant")
    ids = prompt_token_ids(request, tokenizer=None)
    assert ids == list(range(9))
    assert router_mod.request_block_hashes(request, None, BS) == chained(ids, BS, "tenant")
    assert block_hashes_hex(ids, BS, "tenant") != block_hashes_hex(ids, BS, "other")


@pytest.fixture(scope="module")
def tokenizer():
    """The engine's tokenizer for the default model, loaded as `load_checkpoint` loads it."""
    from transformers import AutoTokenizer

    from kvserve.workers.model_executor.loader import resolve_model_dir

    return AutoTokenizer.from_pretrained(resolve_model_dir(None))


def test_text_and_chat_prompts_tokenize_as_the_engine_does(tokenizer):
    prompt = "The capital of France is Paris. " * 5
    text = pb.GenerateRequest(prompt=prompt, cache_salt="s")
    assert prompt_token_ids(text, tokenizer) == to_token_ids(tokenizer, 49152, prompt=prompt)
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": prompt}]
    msgs = pb.GenerateRequest(messages=pb.ChatMessages(messages=[pb.ChatMessage(**m)
                                                                 for m in chat]))
    ids = to_token_ids(tokenizer, 49152, messages=chat)
    assert prompt_token_ids(msgs, tokenizer) == ids
    assert router_mod.request_block_hashes(msgs, tokenizer, 16) == chained(ids, 16, "")


# -- finding the GenerateRequest ---------------------------------------------------------------
def metadata(method: str = "Generate", grpc: bool = True, rid: str = "r1") -> Any:
    return request_metadata(rid, method, grpc)


def pending(arg: Any, **meta: Any) -> PendingRequest:
    return PendingRequest(args=[arg], kwargs={}, metadata=metadata(**meta))


def test_generate_request_from_the_grpc_proxy_or_a_python_handle():
    async def run() -> None:
        request = pb.GenerateRequest(prompt="hi", cache_salt="s")
        from_proxy = pickle.dumps(grpc_request(request))
        assert generate_request_of(pending(from_proxy)) == request
        assert generate_request_of(pending(request, grpc=False)) == request
        assert generate_request_of(pending(from_proxy, grpc=False)) is None  # not unpickled
        tokenize = pickle.dumps(grpc_request(pb.TokenizeRequest(prompt="x")))
        assert generate_request_of(pending(tokenize, method="Tokenize")) is None
        assert generate_request_of(None) is None

    asyncio.run(run())


# -- the router in Serve's routing loop, with fakes --------------------------------------------
class FakeReplica:
    """What Serve's router reads from a RunningReplica."""

    def __init__(self, name: str, queue_len: int = 0, max_ongoing: int = 64,
                 answer_s: float = 0.0) -> None:
        self.replica_id = ReplicaID(unique_id=name, deployment_id=DEPLOYMENT)
        self.queue_len, self.max_ongoing_requests = queue_len, max_ongoing
        self.answer_s = answer_s  # how long it takes to tell its queue length
        self.node_id, self.availability_zone = "node", None
        self.multiplexed_model_ids: set[str] = set()
        self.routing_stats: dict[str, Any] = {}

    async def get_queue_len(self, *, deadline_s: float) -> int:
        await asyncio.sleep(self.answer_s)
        return self.queue_len


class _Method:
    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn

    def remote(self, *args: Any) -> Any:
        return self.fn(*args)


class FakeManager:
    """The cache manager's two calls; `holds[replica]` is the set of hashes it holds."""

    def __init__(self, holds: dict[str, Iterable[str]], block_size: int | None = BS,
                 delay_s: float = 0.0, error: Exception | None = None) -> None:
        self.holds = {r: set(h) for r, h in holds.items()}
        self.size, self.delay_s, self.error = block_size, delay_s, error
        self.asked: list[list[str]] = []
        self.match, self.block_size = _Method(self._match), _Method(self._block_size)

    async def _match(self, hashes: list[str]) -> dict[str, int]:
        self.asked.append(hashes)
        await asyncio.sleep(self.delay_s)
        if self.error is not None:
            raise self.error
        counts = {}
        for replica, held in self.holds.items():
            n = next((i for i, h in enumerate(hashes) if h not in held), len(hashes))
            counts[replica] = n
        return counts

    async def _block_size(self) -> int | None:
        return self.size


def router_namespaces() -> list[dict[str, Any]]:
    """Every globals dict the router's code reads: the module's, and the one its methods got
    if a deployment ran in this process first. Serve pickles the router class by value when
    it deploys (`register_pickle_by_value`), and unpickling it in the same process makes
    cloudpickle overwrite the class's methods with copies whose globals are a new dict, so
    patching the module alone would no longer reach them (it failed when a serving module ran
    before this one)."""
    found = {id(vars(router_mod)): vars(router_mod)}
    for value in vars(CacheAwareRouter).values():
        if inspect.isfunction(value):
            found.setdefault(id(value.__globals__), value.__globals__)
    return list(found.values())


def patch_router(monkeypatch: pytest.MonkeyPatch, name: str, value: Any,
                 namespace: dict[str, Any] | None = None) -> None:
    """`name` is `value` for the router's code (in `namespace` if given)."""
    for ns in [namespace] if namespace is not None else router_namespaces():
        monkeypatch.setitem(ns, name, value)


def use_manager(monkeypatch: pytest.MonkeyPatch, manager: Any,
                namespace: dict[str, Any] | None = None) -> list[str]:
    """Route `_lookup_manager` (in `namespace`, default the router's) to `manager` (an
    exception: raise it); returns the names asked."""
    names: list[str] = []

    def lookup(name: str) -> Any:
        names.append(name)
        if isinstance(manager, Exception):
            raise manager
        return manager

    patch_router(monkeypatch, "_lookup_manager", lookup, namespace)
    return names


@pytest.fixture(autouse=True)
def _no_tokenizer(monkeypatch):
    """The routers here get no tokenizer (text prompts route on load) unless a test puts a
    loader back, so that a proxy's router, which starts loading one when it is made, does not
    load the real one."""
    patch_router(monkeypatch, "_load_tokenizer", lambda model: None)


def make_router(replicas: list[FakeReplica], cls: type = CacheAwareRouter,
                **kwargs: Any) -> CacheAwareRouter:
    router = new_request_router(cls, DEPLOYMENT.app_name, DEPLOYMENT.name)
    router.initialize_state(**kwargs)
    router.update_replicas(replicas)
    return router


async def route(router: CacheAwareRouter, request: Any, rid: str = "r1",
                **meta: Any) -> str:
    """The replica Serve's routing loop picks for `request` (proxy-style pickled args)."""
    arg = pickle.dumps(grpc_request(request))
    pr = PendingRequest(args=[arg], kwargs={}, metadata=metadata(rid=rid, **meta))
    replica = await asyncio.wait_for(route_request(router, pr), 10)
    return replica.replica_id.unique_id


def ids_request(ids: list[int], salt: str = "") -> pb.GenerateRequest:
    return pb.GenerateRequest(prompt_token_ids=pb.TokenIds(ids=ids), cache_salt=salt)


PROMPT = list(range(1, 14))  # 13 tokens: 3 reusable blocks of 4
HASHES = block_hashes_hex(PROMPT, BS, "")


def test_routes_to_the_replica_holding_the_longest_prefix(monkeypatch):
    manager = FakeManager({"a": HASHES[:1], "b": HASHES, "c": []})
    names = use_manager(monkeypatch, manager)

    async def run() -> None:
        router = make_router([FakeReplica("a"), FakeReplica("b", 3), FakeReplica("c")])
        for i in range(5):  # every turn lands on b, whatever the shuffle
            assert await route(router, ids_request(PROMPT), rid=f"t{i}") == "b"
        ranks = await router.choose_replicas(list(router.curr_replicas.values()), pending(
            pickle.dumps(grpc_request(ids_request(PROMPT)))))
        assert [[r.replica_id.unique_id for r in rank] for rank in ranks][0] == ["b"]
        assert sorted(r[0].replica_id.unique_id for r in ranks) == ["a", "b", "c"]

    asyncio.run(run())
    assert names == ["default.Generation"]  # once, by app.deployment
    assert manager.asked[0] == HASHES


def test_an_overloaded_holder_loses_to_the_least_loaded(monkeypatch):
    use_manager(monkeypatch, FakeManager({"a": HASHES}))

    async def run() -> None:
        router = make_router([FakeReplica("a", 12), FakeReplica("b", 1)], imbalance_threshold=8)
        assert await route(router, ids_request(PROMPT)) == "b"
        router2 = make_router([FakeReplica("a", 9), FakeReplica("b", 1)], imbalance_threshold=8)
        assert await route(router2, ids_request(PROMPT)) == "a"

    asyncio.run(run())


def test_a_full_holder_is_skipped_by_serve(monkeypatch):
    use_manager(monkeypatch, FakeManager({"a": HASHES}))

    async def run() -> None:
        router = make_router([FakeReplica("a", 4, max_ongoing=4), FakeReplica("b", 2)],
                             imbalance_threshold=100)
        assert await route(router, ids_request(PROMPT)) == "b"

    asyncio.run(run())


def test_a_holder_slow_to_tell_its_queue_length_still_gets_its_request(monkeypatch):
    """A replica busy with a prefill may take longer than Serve's 0.1 s to answer the queue
    length probe; Serve then passes it over, and the prompt is prefilled cold elsewhere. The
    router's deadline (0.5 s) waits for the holder. Negative control: with Serve's own deadline
    (0.1 s), the request goes to the cold replica."""
    use_manager(monkeypatch, FakeManager({"a": HASHES}))

    async def run(**settings: Any) -> str:
        router = make_router([FakeReplica("a", 1, answer_s=0.25), FakeReplica("b", 0)],
                             **settings)
        return await route(router, ids_request(PROMPT))

    assert asyncio.run(run()) == "a"
    assert asyncio.run(run(queue_len_deadline_s=0.1)) == "b"


def test_salted_prompts_only_match_their_own_tenant(monkeypatch):
    manager = FakeManager({"a": HASHES})
    use_manager(monkeypatch, manager)

    async def run() -> None:
        router = make_router([FakeReplica("a", 1), FakeReplica("b", 0)])
        assert await route(router, ids_request(PROMPT, salt="other")) == "b"

    asyncio.run(run())
    assert manager.asked == [block_hashes_hex(PROMPT, BS, "other")]


def test_missing_manager_routes_on_load_then_is_found_later(monkeypatch):
    names = use_manager(monkeypatch, ValueError("Failed to look up actor"))

    async def run() -> None:
        replicas = [FakeReplica("a", 2), FakeReplica("b", 0)]
        router = make_router(replicas, manager_retry_s=1.0)
        manager = FakeManager({"a": HASHES})
        assert await route(router, ids_request(PROMPT), rid="1") == "b"
        patch_router(monkeypatch, "_lookup_manager", lambda name: manager)
        assert await route(router, ids_request(PROMPT), rid="2") == "b"  # not retried yet
        await asyncio.sleep(1.1)
        assert await route(router, ids_request(PROMPT), rid="3") == "a"

    asyncio.run(run())
    assert names == ["default.Generation"]


def test_a_dead_manager_is_looked_up_again_at_once_then_its_successor_is_used(monkeypatch):
    """An app redeployed under the same name has a new manager; the proxy keeps this router,
    whose handle points at the dead one. The next request finds the successor, instead of
    routing on load for manager_retry_s (negative control: with the usual retry, request 2
    goes to the least-loaded replica b)."""
    from ray.exceptions import ActorDiedError

    dead = FakeManager({"a": HASHES}, error=ActorDiedError())
    successor = FakeManager({"a": HASHES})
    found = iter([dead, successor, dead])
    names = use_manager(monkeypatch, None)
    patch_router(monkeypatch, "_lookup_manager",
                 lambda name: names.append(name) or next(found))

    async def run() -> None:
        router = make_router([FakeReplica("a", 2), FakeReplica("b", 0)], manager_retry_s=60)
        assert await route(router, ids_request(PROMPT), rid="1") == "b"  # the dead one failed
        assert await route(router, ids_request(PROMPT), rid="2") == "a"  # its successor
        assert len(names) == 2

    asyncio.run(run())


def test_concurrent_calls_to_a_dead_manager_look_up_its_successor_at_once(monkeypatch):
    """After a redeploy, requests in flight together all find the old manager dead. Only the
    first failure decides what happens (look the name up again at once); the others must not
    count as a second death in a row, which would ignore the successor for manager_retry_s.
    Negative control: with each concurrent failure counted, the request after them goes to the
    least-loaded replica b, not the holder."""
    from ray.exceptions import ActorDiedError

    old = FakeManager({"a": HASHES}, delay_s=0.05)
    successor = FakeManager({"a": HASHES})
    found = iter([old, successor])
    patch_router(monkeypatch, "_lookup_manager", lambda name: next(found))

    async def run() -> None:
        router = make_router([FakeReplica("a", 2), FakeReplica("b", 0)], manager_retry_s=60)
        assert await route(router, ids_request(PROMPT), rid="before") == "a"
        old.error = ActorDiedError()  # the app is redeployed: its manager is replaced
        together = await asyncio.gather(*(route(router, ids_request(PROMPT), rid=f"c{i}")
                                          for i in range(2)))
        assert together == ["b", "b"]  # the dead one failed both: on load
        assert await route(router, ids_request(PROMPT), rid="next") == "a"  # the successor

    asyncio.run(run())
    assert len(old.asked) == 3 and len(successor.asked) == 1


def test_a_slow_manager_times_out_and_routing_goes_on(monkeypatch):
    manager = FakeManager({"a": HASHES}, delay_s=5.0)
    use_manager(monkeypatch, manager)

    async def run() -> None:
        router = make_router([FakeReplica("a", 1), FakeReplica("b", 0)],
                             manager_timeout_s=0.05, manager_retry_s=60)
        start = time.monotonic()
        assert await route(router, ids_request(PROMPT), rid="1") == "b"
        assert await route(router, ids_request(PROMPT), rid="2") == "b"
        assert time.monotonic() - start < 2.0
        assert router._manager is None

    asyncio.run(run())
    assert len(manager.asked) == 1  # forgotten after the timeout, not asked again


def test_a_dead_manager_is_looked_up_again(monkeypatch):
    manager = FakeManager({"a": HASHES}, error=RuntimeError("The actor died"))
    names = use_manager(monkeypatch, manager)

    async def run() -> None:
        router = make_router([FakeReplica("a", 1), FakeReplica("b", 0)], manager_retry_s=0)
        assert await route(router, ids_request(PROMPT), rid="1") == "b"
        manager.error = None
        assert await route(router, ids_request(PROMPT), rid="2") == "a"

    asyncio.run(run())
    assert names == ["default.Generation", "default.Generation"]


def test_no_block_size_yet_or_other_methods_route_on_load(monkeypatch):
    manager = FakeManager({"a": HASHES}, block_size=None)
    use_manager(monkeypatch, manager)

    async def run() -> None:
        router = make_router([FakeReplica("a", 1), FakeReplica("b", 0)])
        assert await route(router, ids_request(PROMPT), rid="1") == "b"
        manager.size = BS
        assert await route(router, pb.TokenizeRequest(prompt="x"), rid="2",
                           method="Tokenize") == "b"
        assert manager.asked == []
        assert await route(router, ids_request(PROMPT), rid="3") == "a"

    asyncio.run(run())


def test_an_invalid_prompt_routes_on_load(monkeypatch):
    use_manager(monkeypatch, FakeManager({"a": HASHES}))

    async def run() -> None:
        router = make_router([FakeReplica("a", 1), FakeReplica("b", 0)])
        assert await route(router, ids_request([-1, 2, 3, 4, 5, 6])) == "b"
        assert await route(router, pb.GenerateRequest(), rid="2") == "b"  # no input at all

    asyncio.run(run())


def test_text_prompts_hash_with_the_router_loaded_tokenizer(monkeypatch, tokenizer):
    prompt = "You are a helpful assistant. Tell me about the sea."
    ids = to_token_ids(tokenizer, 49152, prompt=prompt)
    manager = FakeManager({"a": block_hashes_hex(ids, BS, "")})
    use_manager(monkeypatch, manager)
    patch_router(monkeypatch, "_load_tokenizer", LOAD_TOKENIZER)

    async def run() -> None:
        router = make_router([FakeReplica("a", 1), FakeReplica("b", 0)], tokenizer_wait_s=120)
        assert await route(router, pb.GenerateRequest(prompt=prompt)) == "a"

    asyncio.run(run())  # the router loads its own tokenizer (loader.load_tokenizer)
    assert manager.asked == [block_hashes_hex(ids, BS, "")]


def test_a_tokenizer_still_loading_does_not_hold_routing(monkeypatch, tokenizer):
    def slow_load(model: str | None) -> Any:
        time.sleep(0.5)
        return tokenizer

    patch_router(monkeypatch, "_load_tokenizer", slow_load)
    prompt = "one two three four five six seven eight nine ten eleven twelve"
    manager = FakeManager({"a": block_hashes_hex(to_token_ids(tokenizer, 1, prompt=prompt),
                                                 BS, "")})
    use_manager(monkeypatch, manager)

    async def run() -> None:
        router = make_router([FakeReplica("a", 1), FakeReplica("b", 0)], tokenizer_wait_s=0.05)
        assert await route(router, pb.GenerateRequest(prompt=prompt), rid="1") == "b"
        assert not router._tokenizer_future.done()
        await asyncio.wait_for(asyncio.wrap_future(router._tokenizer_future), 30)
        assert await route(router, pb.GenerateRequest(prompt=prompt), rid="2") == "a"

    asyncio.run(run())


def test_a_hung_tokenizer_load_holds_routing_once_not_every_request(monkeypatch, tokenizer):
    """Requests wait for the tokenizer until one deadline, `tokenizer_wait_s` after its load
    began. With a wait per request, a load that never ends (a stuck import, a lock held by
    another process) made every request of the deployment wait the whole `tokenizer_wait_s`:
    48 users of a burst got their refusals after 10 s."""
    release = threading.Event()

    def hung_load(model: str | None) -> Any:
        release.wait(60)
        return tokenizer

    patch_router(monkeypatch, "_load_tokenizer", hung_load)
    use_manager(monkeypatch, FakeManager({"a": HASHES}))

    async def run() -> list[float]:
        router = make_router([FakeReplica("a", 1), FakeReplica("b", 0)], tokenizer_wait_s=0.5)
        took = []
        for rid in "123":
            start = time.monotonic()
            assert await route(router, pb.GenerateRequest(prompt="hello"), rid=rid) == "b"
            took.append(time.monotonic() - start)
        return took

    try:
        first, *later = asyncio.run(run())
    finally:
        release.set()
    assert first >= 0.45, first  # the first request waited for the load, up to the deadline
    assert max(later) < 0.2, later  # past it, the others route on load at once


def test_a_proxys_router_loads_the_tokenizer_from_its_creation_others_at_the_first_prompt(
        monkeypatch):
    """Serve creates a proxy's router when the deployment's replicas are announced, before any
    request. Loading the tokenizer (importing transformers) there and then, not at the first
    text prompt, kept a fresh deployment's first requests from waiting ~4 s for it in the
    proxy: under CI load a burst of 48 users saw its refusals come back after 11 s, not 0.3 s.
    A driver's router (`kvserve cache check`) loads none unless a text prompt needs it: the
    load would keep the command from exiting for seconds."""
    started = []

    def load(model: str | None) -> Any:
        started.append(model)
        return None

    patch_router(monkeypatch, "_load_tokenizer", load)
    use_manager(monkeypatch, FakeManager({"a": HASHES}))
    in_proxy = [True]  # ray_compat.routes_for_a_proxy (tests/test_ray_compat.py), in a proxy
    patch_router(monkeypatch, "routes_for_a_proxy", lambda router: in_proxy[0])

    async def run() -> None:
        proxy = make_router([FakeReplica("a", 0)], model="m")
        in_proxy[0] = False
        await asyncio.wait_for(asyncio.wrap_future(proxy._tokenizer_future), 10)
        assert started == ["m"]  # no request was routed
        await route(proxy, pb.GenerateRequest(prompt="hello"))
        assert started == ["m"]  # and the first one does not load it again

        driver = make_router([FakeReplica("a", 0)], model="d")
        await route(driver, ids_request(PROMPT))  # token ids: no tokenizer needed
        assert driver._tokenizer_future is None and started == ["m"]
        await route(driver, pb.GenerateRequest(prompt="hello"), rid="2")
        assert started == ["m", "d"]

    asyncio.run(run())


def test_the_config_carries_the_router_class_and_options():
    config = request_router_config("my-model", imbalance_threshold=3)
    assert config.request_router_class == "kvserve.cluster.router.CacheAwareRouter"
    assert config.request_router_kwargs["model"] == "my-model"
    assert config.request_router_kwargs["imbalance_threshold"] == 3
    assert config.get_request_router_class() is CacheAwareRouter


def _route_with_unpickled_router(serialized: bytes, fields: dict[str, Any]) -> None:
    """In a fresh process, as in Serve's proxy: the class comes by value, with its own globals."""
    config = RequestRouterConfig.from_serialized_request_router_cls(fields, serialized)
    cls = config.get_request_router_class()
    assert cls is not CacheAwareRouter
    kwargs = config.request_router_kwargs
    monkeypatch = pytest.MonkeyPatch()
    use_manager(monkeypatch, FakeManager({"a": HASHES}), cls._get_manager.__globals__)

    async def run() -> None:
        router = make_router([FakeReplica("a", 3), FakeReplica("b", 0)], cls=cls, **kwargs)
        assert await route(router, ids_request(PROMPT)) == "a"
        big = make_router([FakeReplica("a", 4), FakeReplica("b", 0)], cls=cls, **kwargs)
        assert await route(big, ids_request(PROMPT)) == "b"
        down = make_router([FakeReplica("a", 1), FakeReplica("b", 0)], cls=cls, **kwargs)
        use_manager(monkeypatch, ValueError("no actor"), cls._get_manager.__globals__)
        assert await route(down, ids_request(PROMPT)) == "b"

    asyncio.run(run())


def test_the_router_class_as_serve_ships_it_to_another_process(tmp_path):
    config = request_router_config(None, imbalance_threshold=3)
    blob = tmp_path / "router.pkl"
    fields = {"request_router_class": config.request_router_class,
              "request_router_kwargs": config.request_router_kwargs}
    blob.write_bytes(pickle.dumps((config.get_serialized_request_router_cls(), fields)))
    script = ("import pickle, sys; from tests.test_router import _route_with_unpickled_router; "
              f"_route_with_unpickled_router(*pickle.loads(open({str(blob)!r}, 'rb').read()))")
    root = Path(__file__).resolve().parent.parent
    done = subprocess.run([sys.executable, "-c", script], cwd=root, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]


def test_looking_up_the_manager_without_ray_never_starts_a_cluster():
    """A handle's router can outlive ray.shutdown(); its next lookup must fail (route on load),
    not let ray.get_actor auto-start a local cluster (seconds of stall, a stray Ray)."""
    import ray

    assert not ray.is_initialized()
    with pytest.raises(ConnectionError, match="not connected to Ray"):
        router_mod._lookup_manager("default.Generation")
    assert not ray.is_initialized()
