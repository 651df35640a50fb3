"""A Serve replica's tensor-parallel ranks 1..N-1 as Ray actors in the replica's own placement
group, as Ray Serve LLM places a multi-GPU engine: the deployment reserves one bundle per rank
(`kvserve.cluster.app.build_app`: STRICT_PACK, so every rank shares the replica's node and its
loopback), Serve puts the replica (rank 0) in bundle 0, and rank r's actor goes to bundle r.

The engine knows nothing of Ray: it takes `launcher(...)` as its `rank_launcher`, and each
actor runs the engine's own rank loop (`kvserve.workers.parallel.ranks.rank_main`). The actors
are the replica's children: when the replica dies, Ray ends them with it, and Serve removes
the placement group with the replica.
"""

from __future__ import annotations

import logging
from typing import Any

import ray
from ray.util.placement_group import PlacementGroup, get_current_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from kvserve.workers.parallel.ranks import RankArgs, RankLauncher, RankProcess, rank_main

logger = logging.getLogger("ray.serve")


@ray.remote(max_concurrency=2)  # `run` blocks for the actor's life; `pid` still answers
class RankActor:
    def run(self, args: RankArgs) -> None:
        rank_main(args)

    def pid(self) -> int:
        import os

        return os.getpid()


class RayRank:
    """A rank actor as the engine's `RankProcess`: alive while its `run` call is; stopping it
    kills the actor (an actor outlives its method otherwise)."""

    def __init__(self, actor: Any, run: ray.ObjectRef, rank: int) -> None:
        self.actor, self.run, self.name = actor, run, f"kvserve-tp-rank-{rank}"
        self._pid: int | None = None
        self._exitcode: int | None = None

    @property
    def pid(self) -> int | None:
        if self._pid is None:
            try:
                self._pid = ray.get(self.actor.pid.remote(), timeout=30)
            except Exception:  # noqa: BLE001 - a dead actor has no pid to show
                return None
        return self._pid

    @property
    def exitcode(self) -> int | None:
        if self._exitcode is None and not self.is_alive():
            try:
                ray.get(self.run, timeout=0)
                self._exitcode = 0
            except Exception:  # noqa: BLE001 - the actor died or its loop raised
                self._exitcode = 1
        return self._exitcode

    def is_alive(self) -> bool:
        ready, _ = ray.wait([self.run], timeout=0)
        return not ready

    def join(self, timeout: float | None = None) -> None:
        ray.wait([self.run], timeout=timeout)
        if not self.is_alive():
            self.kill()

    def terminate(self) -> None:
        self.kill()

    def kill(self) -> None:
        ray.kill(self.actor, no_restart=True)


def launcher(placement_group: PlacementGroup | None = None) -> RankLauncher:
    """Start rank r as an actor taking all of bundle r of `placement_group` (default: the
    calling replica's own)."""
    group = placement_group or get_current_placement_group()
    if group is None:
        raise RuntimeError("tensor_parallel_size > 1 needs the replica's placement group "
                           "(build_app reserves one bundle per rank)")

    def launch(args: RankArgs) -> RankProcess:
        if args.rank >= len(group.bundle_specs):
            raise RuntimeError(f"the replica's placement group has {len(group.bundle_specs)} "
                               f"bundles, not one for each of {args.size} ranks")
        bundle = group.bundle_specs[args.rank]
        actor = RankActor.options(
            num_cpus=bundle.get("CPU", 0), num_gpus=bundle.get("GPU", 0),
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                group, placement_group_bundle_index=args.rank),
        ).remote()
        return RayRank(actor, actor.run.remote(args), args.rank)

    return launch


def bundles(size: int, cpus: float, gpus: float) -> list[dict[str, float]]:
    """A replica's placement group: one bundle per rank, rank 0 (the replica) in the first."""
    bundle = {"CPU": cpus, **({"GPU": gpus} if gpus else {})}
    return [dict(bundle) for _ in range(size)]
