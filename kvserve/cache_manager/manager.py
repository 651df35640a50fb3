"""The cache manager's logic: keep the Redis index equal to what the workers hold.

Workers send batched reports; the manager writes them to Redis and answers whether it needs a
full report instead of deltas: after its own restart (it has not seen the replica since), and
whenever Redis lost the replica's keys (a Redis restart, a lease that ran out) or a write
failed. Deltas applied on top of a full report reproduce the worker's state, so the index heals
itself. `check` compares the index with the workers' actual state (`kvserve cache check`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import redis

from kvserve.cache_manager.index import TIERS, KVIndex, ReplicaReport


@dataclass
class ReplicaState:
    """What one worker actually holds (hex block hashes), to check the index against."""

    replica_id: str
    device: list[str]
    host: list[str]
    requests: dict[str, int]  # live request id -> blocks


class CacheManager:
    def __init__(self, index: KVIndex) -> None:
        self.index = index
        self.synced: set[str] = set()  # replicas whose last full report Redis still has
        self.block_size: int | None = None
        self.num_full_reports = 0

    def report(self, report: ReplicaReport) -> bool:
        """Apply a report; True asks the replica for a full report next."""
        rid = report.replica_id
        try:
            existed = self.index.apply(report)
        except redis.RedisError:
            self.synced.clear()  # we no longer know what reached Redis, for anybody
            return True
        self.block_size = report.usage.block_size or self.block_size
        if report.full:
            self.synced.add(rid)
            self.num_full_reports += 1
            return False
        if not existed or rid not in self.synced:
            self.synced.discard(rid)
            return True
        return False

    def match(self, block_hashes: list[str]) -> dict[str, int]:
        """Live replica -> leading blocks of `block_hashes` it holds; {} if Redis is down."""
        try:
            return self.index.match(block_hashes)
        except redis.RedisError:
            return {}

    def summary(self) -> dict[str, dict]:
        """Live replica -> its usage (block counts, prefix tokens) and live request count."""
        out = {}
        for rid in self.index.live_replicas():
            usage = self.index.usage(rid)
            if usage is not None:
                out[rid] = {**asdict(usage), "requests": len(self.index.requests(rid))}
        return out

    def check(self, states: list[ReplicaState]) -> list[str]:
        """Every difference between Redis and the workers' state, as readable lines."""
        workers = {s.replica_id: s for s in states}
        live = set(self.index.live_replicas())
        problems = [f"replica {rid}: in Redis but not running"
                    for rid in sorted(live - set(workers))]
        problems += [f"replica {rid}: running but missing from Redis"
                     for rid in sorted(set(workers) - live)]
        for rid in sorted(live & set(workers)):
            problems += self._check_replica(workers[rid])
        return problems

    def _check_replica(self, state: ReplicaState) -> list[str]:
        problems = []
        for tier in TIERS:
            actual, indexed = set(getattr(state, tier)), self.index.blocks(state.replica_id, tier)
            problems += _diff(f"replica {state.replica_id} {tier} block", actual, indexed)
        indexed_requests = self.index.requests(state.replica_id)
        problems += _diff(f"replica {state.replica_id} request", set(state.requests),
                          set(indexed_requests))
        return problems

    def delete_all(self) -> int:
        self.synced.clear()
        return self.index.delete_all()


def _diff(what: str, actual: set[str], indexed: set[str]) -> list[str]:
    missing = [f"{what} {h}: held by the worker, missing from Redis"
               for h in sorted(actual - indexed)]
    return missing + [f"{what} {h}: in Redis, not held by the worker"
                      for h in sorted(indexed - actual)]
