"""Cache-aware request routing: a Ray Serve custom request router for the Generation deployment.

A request goes to the replica holding the longest cached prefix of its prompt, unless that
replica is overloaded compared with the others, in which case the least-loaded replica wins.
Multi-turn chat thus keeps landing where its history is cached, and its prefill is skipped.

Per request the router:
1. finds the `GenerateRequest` in the handle call's arguments (other methods route on load);
2. computes the prompt's token ids exactly as the engine does
(`kvserve.cluster.convert.prompt_input`,
   `kvserve.workers.core.inputs.to_token_ids`, the model's own tokenizer) and the chained hashes of
   its full
   blocks (`kvserve.workers.core.prefix_hash`), leaving out the last prompt token, which the engine
   always
   recomputes;
3. asks the central cache manager actor how many leading blocks each replica holds;
4. ranks the replicas with `choose_replica_ids` (load = ongoing requests, from Serve's queue
   length cache or a probe, as Serve's own routers measure it: the parts of Serve's router this
   needs that are not public are reached through `kvserve.cluster.ray_compat`).

Routing never fails for want of a cache view: a missing, dead or slow manager, an unknown block
size, a tokenizer still loading or an invalid prompt all route on load alone.

Serve runs the router in every process holding a handle to the deployment: for gRPC clients
that is the gRPC proxy, where each request arrives as a pickled `gRPCRequest` (bytes).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import pickle
import random
import time
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import ray
from ray.exceptions import ActorDiedError
from ray.serve.config import RequestRouterConfig
from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

from kvserve.cache_manager.actor import deployment_key
from kvserve.cluster.convert import prompt_input
from kvserve.cluster.ray_compat import (
    probe_queue_lens,
    queue_len_cache_enabled,
    routed_deployment,
    routes_for_a_proxy,
)
from kvserve.v1 import generation_pb2 as pb
from kvserve.workers.core.inputs import to_token_ids
from kvserve.workers.core.prefix_hash import extend_block_hashes

logger = logging.getLogger("ray.serve")

ROUTER_CLASS = "kvserve.cluster.router.CacheAwareRouter"
GENERATE_METHOD = "Generate"
# A cached holder is "overloaded" when its ongoing requests exceed the least-loaded replica's
# by more than this. Lower favours balance, higher favours cache hits (long shared prefixes).
DEFAULT_IMBALANCE_THRESHOLD = 8.0
DEFAULT_MANAGER_TIMEOUT_S = 0.5  # per call to the cache manager; past it, route on load
# How long a replica has to say how many requests it holds before Serve's routing passes it
# over (Serve's default: 0.1 s, doubling on retries up to 1 s). A replica busy with a prefill
# answers slower than that on a loaded host (on 2 busy cores several probes of a holder can
# miss 0.1 s at once, and a chat's turn of 561 tokens is then prefilled cold elsewhere, 2 s);
# passing over the holder costs a whole prefill, waiting costs at most this.
DEFAULT_QUEUE_LEN_DEADLINE_S = 0.5
DEFAULT_MANAGER_RETRY_S = 5.0  # after a failure, look the manager up again no sooner
# requests wait for the tokenizer until this long after its load began (one deadline for all)
DEFAULT_TOKENIZER_WAIT_S = 10.0
_ANY_VOCAB = 2**31  # ids are int32; the replica checks them against the real vocabulary
_HASH_MEMO_SIZE = 1024  # requests whose hashes are kept for their retries


class ManagerUnavailableError(Exception):
    """The cache manager could not answer: route on load alone."""


# -- pure parts --------------------------------------------------------------------------------
def choose_replica_ids(
    matched: Mapping[str, int],
    load: Mapping[str, float],
    *,
    imbalance_threshold: float = DEFAULT_IMBALANCE_THRESHOLD,
    min_matched_blocks: int = 1,
    capacity: int | None = None,
) -> list[str]:
    """The candidate replicas (the keys of `load`), best first.

    `matched[r]`: leading prompt blocks replica r holds (absent: none); `load[r]`: its ongoing
    requests (inf: unknown). A replica is overloaded when its load exceeds the least-loaded
    candidate's by more than `imbalance_threshold`, or when it already holds `capacity`
    requests (the most it admits: one more would be refused at once, however warm its cache).
    First comes the longest holder (at least `min_matched_blocks`) that is not overloaded, ties
    to the less loaded; then everyone else, least loaded first. With no such holder, least
    loaded first. Full ties keep `load`'s order.
    """
    if not load:
        return []
    least = min(load.values())
    by_load = sorted(load, key=lambda r: (load[r], -matched.get(r, 0)))
    balanced = [r for r in load if load[r] - least <= imbalance_threshold  # inf-inf: no
                and (capacity is None or load[r] < capacity)]
    best = max(balanced, key=lambda r: (matched.get(r, 0), -load[r]), default=None)
    if best is None or matched.get(best, 0) < min_matched_blocks:
        return by_load
    return [best, *(r for r in by_load if r != best)]


def block_hashes_hex(token_ids: Sequence[int], block_size: int, salt: str) -> list[str]:
    """Hex hashes of the prompt's full blocks the engine can reuse (all but the last token)."""
    hashes: list[bytes] = []
    num_blocks = max(0, (len(token_ids) - 1) // block_size)
    extend_block_hashes(hashes, token_ids, block_size, num_blocks, salt)
    return [h.hex() for h in hashes]


def prompt_token_ids(request: pb.GenerateRequest, tokenizer: Any) -> list[int]:
    """The request's prompt as the engine tokenizes it (`tokenizer` unused for token ids)."""
    return to_token_ids(tokenizer, _ANY_VOCAB, **prompt_input(request))


def request_block_hashes(request: pb.GenerateRequest, tokenizer: Any, block_size: int) -> list[str]:
    return block_hashes_hex(prompt_token_ids(request, tokenizer), block_size, request.cache_salt)


def generate_request_of(pending_request: PendingRequest | None) -> pb.GenerateRequest | None:
    """The `GenerateRequest` a Generate call carries: as the gRPC proxy sends it (a pickled
    `gRPCRequest`), unpickled, or the message itself (a Python handle call)."""
    if pending_request is None or pending_request.metadata.call_method != GENERATE_METHOD:
        return None
    for arg in pending_request.args:
        if isinstance(arg, bytes) and pending_request.metadata.is_grpc_request:
            arg = pickle.loads(arg)  # the proxy pickled it, in this process
        arg = getattr(arg, "user_request_proto", arg)
        if isinstance(arg, pb.GenerateRequest):
            return arg
    return None


@dataclass(frozen=True)
class RouterSettings:
    """The router's settings, defined once: `request_router_config` checks and ships them as
    Serve's `request_router_kwargs`, and `initialize_state` receives them back.

    `model` must be the engine's (`EngineConfig.model`): its tokenizer makes the hashes.
    `replica_capacity`: the requests a replica admits (running + waiting; None: no bound).
    `queue_len_deadline_s`: how long a replica's probe may take before Serve passes it over.
    `deployment_name` names the cache manager to ask (default: the routed deployment's)."""

    model: str | None = None
    imbalance_threshold: float = DEFAULT_IMBALANCE_THRESHOLD
    min_matched_blocks: int = 1
    replica_capacity: int | None = None
    manager_timeout_s: float = DEFAULT_MANAGER_TIMEOUT_S
    queue_len_deadline_s: float = DEFAULT_QUEUE_LEN_DEADLINE_S
    manager_retry_s: float = DEFAULT_MANAGER_RETRY_S
    tokenizer_wait_s: float = DEFAULT_TOKENIZER_WAIT_S
    deployment_name: str | None = None


def request_router_config(model: str | None = None, **settings: Any) -> RequestRouterConfig:
    """`deployment.options(request_router_config=request_router_config(model))` turns it on;
    `settings` are RouterSettings' other fields (a wrong name fails here, not in the proxy)."""
    kwargs = dataclasses.asdict(RouterSettings(model=model, **settings))
    return RequestRouterConfig(request_router_class=ROUTER_CLASS, request_router_kwargs=kwargs)


def _lookup_manager(deployment_name: str) -> Any:
    from kvserve.cache_manager.actor import MANAGER_NAMESPACE, manager_name

    if not ray.is_initialized():  # e.g. a handle's router outliving ray.shutdown(): get_actor
        raise ConnectionError("not connected to Ray")  # would start a whole new local cluster
    return ray.get_actor(manager_name(deployment_name), namespace=MANAGER_NAMESPACE)


def _load_tokenizer(model: str | None) -> Any:
    from kvserve.workers.model_executor.loader import load_tokenizer

    return load_tokenizer(model)


# -- the router --------------------------------------------------------------------------------
class CacheAwareRouter(RequestRouter):
    """Longest cached prefix first, unless overloaded; see the module docstring.

    Not FIFOMixin: a replica chosen for a request must go to that request, not to the oldest
    one waiting. Not LocalityMixin: a cache hit on another node beats a cold local replica."""

    def initialize_state(self, **kwargs: Any) -> None:
        """Serve calls it with `RequestRouterConfig.request_router_kwargs` (RouterSettings)."""
        settings = RouterSettings(**kwargs)
        self._model = settings.model
        self._imbalance_threshold = float(settings.imbalance_threshold)
        self._min_matched_blocks = int(settings.min_matched_blocks)
        self._capacity = settings.replica_capacity
        self._manager_timeout_s = settings.manager_timeout_s
        self._manager_retry_s = settings.manager_retry_s
        # Serve's own deadline attributes (public on RequestRouter), read by every probe of this
        # router's: the first try's, then doubling up to the maximum
        self.queue_len_response_deadline_s = float(settings.queue_len_deadline_s)
        self.max_queue_len_response_deadline_s = max(self.max_queue_len_response_deadline_s,
                                                     self.queue_len_response_deadline_s)
        self._tokenizer_wait_s = settings.tokenizer_wait_s
        self._deployment_name = (settings.deployment_name
                                 or deployment_key(*routed_deployment(self)))
        self._manager: Any = None
        self._manager_retry_at = 0.0
        self._relooked = False  # the last failure was a dead manager, looked up again at once
        self._block_size: int | None = None
        # one thread: tokenizer calls never overlap, and the load runs before them
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="kvserve-router")
        self._tokenizer_future: Future | None = None
        self._tokenizer_deadline = 0.0  # requests wait for the load until then (monotonic)
        # In a proxy, loaded from now: Serve makes the proxy's router when the deployment's
        # replicas are announced, so the load (importing transformers: ~4 s of a busy proxy's
        # GIL, which held a fresh deployment's first requests as long) is over before traffic
        # comes. Elsewhere (a driver's `kvserve cache check`) only once a text prompt needs it.
        if routes_for_a_proxy(self):
            self._load_tokenizer_soon()
        self._hash_memo: OrderedDict[str, tuple[int, list[str]]] = OrderedDict()

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        """One rank per replica, best first: Serve tries each in turn (skipping full ones),
        then backs off and asks again."""
        if pending_request is not None:
            pending_request.routing_context.should_backoff = True
        if not candidate_replicas:
            return []
        replicas = random.sample(candidate_replicas, len(candidate_replicas))  # fair full ties
        load, matched = await asyncio.gather(
            self._loads(replicas), self._matched_blocks(pending_request))
        order = choose_replica_ids(matched, load, imbalance_threshold=self._imbalance_threshold,
                                   min_matched_blocks=self._min_matched_blocks,
                                   capacity=self._capacity)
        by_id = {r.replica_id.unique_id: r for r in replicas}
        return [[by_id[replica_id]] for replica_id in order]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: Any,
                          result: Any) -> None:
        self._hash_memo.pop(pending_request.metadata.internal_request_id, None)

    # -- load ------------------------------------------------------------------------------
    async def _loads(self, replicas: list[RunningReplica]) -> dict[str, float]:
        """Ongoing requests per replica: Serve's queue length cache, else a probe (inf when
        the probe gets no answer)."""
        known: dict[str, float] = {}
        to_probe = []
        for r in replicas:
            queue_len = (self.replica_queue_len_cache.get(r.replica_id)
                         if queue_len_cache_enabled(self) else None)
            if queue_len is None:
                to_probe.append(r)
            else:
                known[r.replica_id.unique_id] = queue_len
        if to_probe:
            for r, queue_len in await probe_queue_lens(self, to_probe):
                if queue_len is not None:
                    known[r.replica_id.unique_id] = queue_len
        return {r.replica_id.unique_id: float(known.get(r.replica_id.unique_id, math.inf))
                for r in replicas}

    # -- cache view ------------------------------------------------------------------------
    async def _matched_blocks(self, pending_request: PendingRequest | None) -> dict[str, int]:
        """Replica id -> leading prompt blocks it holds; {} when that cannot be known."""
        request = generate_request_of(pending_request)
        if request is None:
            return {}
        try:
            block_size = await self._get_block_size()
            if block_size is None:
                return {}
            hashes = await self._hashes(pending_request, request, block_size)
            if not hashes:
                return {}
            return dict(await self._ask("match", hashes))
        except ManagerUnavailableError:
            return {}
        except Exception as exc:  # an invalid prompt (the replica will say so), a bad reply
            logger.debug("cache-aware routing skipped for a request: %r", exc)
            return {}

    async def _get_block_size(self) -> int | None:
        if self._block_size is None:
            self._block_size = await self._ask("block_size")
        return self._block_size

    async def _hashes(self, pending_request: PendingRequest, request: pb.GenerateRequest,
                      block_size: int) -> list[str]:
        """The prompt's block hashes, computed once per request (retries reuse them)."""
        key = pending_request.metadata.internal_request_id
        memo = self._hash_memo.get(key)
        if memo is not None and memo[0] == block_size:
            return memo[1]
        tokenizer = None
        if request.WhichOneof("input") != "prompt_token_ids":
            tokenizer = await self._tokenizer()
            if tokenizer is None:
                return []
        loop = asyncio.get_running_loop()
        hashes = await loop.run_in_executor(
            self._executor, request_block_hashes, request, tokenizer, block_size)
        self._hash_memo[key] = (block_size, hashes)
        while len(self._hash_memo) > _HASH_MEMO_SIZE:
            self._hash_memo.popitem(last=False)
        return hashes

    async def _tokenizer(self) -> Any:
        """The model's tokenizer, loaded once in the router's thread; None while it is still
        loading `tokenizer_wait_s` after the load began, or if it failed to load.

        The wait ends at one deadline for all requests, counted from the load's start: a slow
        or hung load holds routing once, by at most that, not every request by that much."""
        future = self._load_tokenizer_soon()
        wait_s = self._tokenizer_deadline - time.monotonic()
        if not future.done() and wait_s > 0:
            await asyncio.wait([asyncio.wrap_future(future)], timeout=wait_s)
        if not future.done() or future.exception() is not None:
            return None
        return future.result()

    def _load_tokenizer_soon(self) -> Future:
        if self._tokenizer_future is None:
            self._tokenizer_deadline = time.monotonic() + self._tokenizer_wait_s
            self._tokenizer_future = self._executor.submit(_load_tokenizer, self._model)
            self._tokenizer_future.add_done_callback(_log_tokenizer_failure)
        return self._tokenizer_future

    # -- the cache manager -----------------------------------------------------------------
    async def _ask(self, method: str, *args: Any) -> Any:
        """One call to the cache manager, within `manager_timeout_s`. A failure forgets the
        manager (looked up again after `manager_retry_s`) and raises ManagerUnavailableError."""
        manager = await self._get_manager()
        if manager is None:
            raise ManagerUnavailableError
        try:
            result = await asyncio.wait_for(getattr(manager, method).remote(*args),
                                            self._manager_timeout_s)
        except Exception as exc:  # dead actor, timeout, error in the manager
            if manager is not self._manager:  # a concurrent call's failure already forgot it
                raise ManagerUnavailableError from exc
            self._manager, self._block_size = None, None
            # A dead actor's name may already belong to its successor: an app redeployed under
            # the same name starts a new manager, which Serve's proxy, keeping this router,
            # would otherwise ignore for manager_retry_s. So the first death is looked up again
            # at the next request; a second in a row waits, as any other failure does.
            relook = isinstance(exc, ActorDiedError) and not self._relooked
            self._relooked = relook
            retry_s = 0.0 if relook else self._manager_retry_s
            logger.warning("cache manager %s failed (%r); routing on load for %.0f s",
                           method, exc, retry_s)
            self._manager_retry_at = time.monotonic() + retry_s
            raise ManagerUnavailableError from exc
        else:
            self._relooked = False
            return result

    async def _get_manager(self) -> Any:
        if self._manager is not None or time.monotonic() < self._manager_retry_at:
            return self._manager
        self._manager_retry_at = time.monotonic() + self._manager_retry_s
        try:  # ray.get_actor blocks on the GCS: not on the event loop
            self._manager = await asyncio.wait_for(
                asyncio.to_thread(_lookup_manager, self._deployment_name),
                self._manager_timeout_s)
        except Exception as exc:  # not started yet, dead, or the GCS is slow
            logger.info("no cache manager for %s (%r); routing on load",
                        self._deployment_name, exc)
        return self._manager


def _log_tokenizer_failure(future: Future) -> None:
    if not future.cancelled() and future.exception() is not None:
        logger.error("cache-aware router: tokenizer failed to load; routing on load only",
                     exc_info=future.exception())
