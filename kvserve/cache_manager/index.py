"""The cluster-wide KV index in Redis, one namespace per deployment.

Key schema (`{ns}` is `kvserve:{deployment}`); every per-replica key carries the replica's lease
TTL, renewed by each report, so a dead replica's entries vanish within the TTL:

    {ns}:replicas                       set    replica ids that ever reported (pruned on read)
    {ns}:replica:{rid}                  hash   ReplicaUsage's fields (block counts per tier,
                                               prefix tokens queried / hit, block_size),
                                               updated_at                           (TTL)
    {ns}:replica:{rid}:blocks:{tier}    set    hex block hashes cached there, tier device|host
                                                                                   (TTL)
    {ns}:replica:{rid}:requests         hash   request id -> blocks held            (TTL)

Writes are pipelined (one round trip per report, a MULTI transaction). A report is either a
delta (blocks stored / removed since the last one) or full (every cached hash: replaces the
sets); `apply` says whether the replica's keys were there before, so a Redis that restarted
empty (or a lease that ran out) is noticed and answered with a request for a full report.
Lookups (`holders`, `match`) ask each live replica's sets, cheap for the handful of replicas a
deployment has.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field

import redis

TIERS = ("device", "host")
# The cache manager's two timings, defined here once (AppConfig, the deployment and the actor
# read them). A replica's index entries expire this long after its last report, so a dead
# replica's blocks leave routing within it; replicas report at least every second (heartbeat)
LEASE_TTL_S = 10.0
# replicas batch their KV events this long before reporting: fresh enough for routing, few calls
REPORT_INTERVAL_MS = 50.0


@dataclass
class ReplicaUsage:
    device_total: int
    device_used: int  # held by live requests
    device_cached: int  # unreferenced, kept for prefix hits
    host_total: int = 0
    host_used: int = 0
    host_cached: int = 0
    prefix_queried_tokens: int = 0
    prefix_hit_tokens: int = 0
    block_size: int = 0


@dataclass
class ReplicaReport:
    """A replica's batched events since its last report (never sent per token)."""

    replica_id: str
    usage: ReplicaUsage
    stored: dict[str, list[str]] = field(default_factory=dict)  # tier -> hex hashes now there
    removed: dict[str, list[str]] = field(default_factory=dict)  # tier -> hex hashes gone
    requests: dict[str, int] | None = None  # every live request -> its blocks; None: unchanged
    full: bool = False  # `stored` lists every cached hash: replace the replica's sets


class KVIndex:
    def __init__(self, client: redis.Redis, deployment: str,
                 lease_ttl_s: float = LEASE_TTL_S) -> None:
        if lease_ttl_s <= 0:
            raise ValueError("lease_ttl_s must be positive")
        self.client = client
        self.ns = f"kvserve:{deployment}"
        self.lease_ms = int(lease_ttl_s * 1000)

    def _replica(self, rid: str) -> str:
        return f"{self.ns}:replica:{rid}"

    def apply(self, report: ReplicaReport) -> bool:
        """Record a report and renew the replica's lease, in one transaction. Returns whether
        the replica's keys existed before (False: first report, lost lease or emptied Redis)."""
        rid, key = report.replica_id, self._replica(report.replica_id)
        pipe = self.client.pipeline(transaction=True)
        pipe.exists(key)
        pipe.sadd(f"{self.ns}:replicas", rid)
        pipe.hset(key, mapping={**asdict(report.usage), "updated_at": time.time()})
        if report.full:
            pipe.delete(*(f"{key}:blocks:{tier}" for tier in TIERS))
        for tier in TIERS:
            blocks = f"{key}:blocks:{tier}"
            if report.stored.get(tier):
                pipe.sadd(blocks, *report.stored[tier])
            if report.removed.get(tier):
                pipe.srem(blocks, *report.removed[tier])
        if report.requests is not None:
            pipe.delete(f"{key}:requests")
            if report.requests:
                pipe.hset(f"{key}:requests", mapping=report.requests)
        for suffix in ("", *(f":blocks:{t}" for t in TIERS), ":requests"):
            pipe.pexpire(key + suffix, self.lease_ms)
        return bool(pipe.execute()[0])

    def live_replicas(self) -> list[str]:
        """Replicas whose lease has not run out (dead ones are pruned from the set)."""
        rids = sorted(r.decode() for r in self.client.smembers(f"{self.ns}:replicas"))
        alive = [rid for rid, exists in zip(rids, self._exist(rids), strict=True) if exists]
        dead = set(rids) - set(alive)
        if dead:
            self.client.srem(f"{self.ns}:replicas", *dead)
        return alive

    def _exist(self, rids: list[str]) -> list[bool]:
        pipe = self.client.pipeline(transaction=False)
        for rid in rids:
            pipe.exists(self._replica(rid))
        return [bool(n) for n in pipe.execute()]

    def usage(self, replica_id: str) -> ReplicaUsage | None:
        raw = self.client.hgetall(self._replica(replica_id))
        if not raw:
            return None
        values = {k.decode(): float(v) for k, v in raw.items()}
        return ReplicaUsage(**{k: int(values[k]) for k in ReplicaUsage.__dataclass_fields__})

    def holders(self, block_hash: str) -> dict[str, list[str]]:
        """Live replica id -> tiers that hold `block_hash`."""
        rids = self.live_replicas()
        pipe = self.client.pipeline(transaction=False)
        for rid in rids:
            for tier in TIERS:
                pipe.sismember(f"{self._replica(rid)}:blocks:{tier}", block_hash)
        found = iter(pipe.execute())
        held = {rid: [t for t in TIERS if next(found)] for rid in rids}
        return {rid: tiers for rid, tiers in held.items() if tiers}

    def match(self, block_hashes: list[str]) -> dict[str, int]:
        """Live replica id -> how many leading `block_hashes` it holds (either tier)."""
        rids = self.live_replicas()
        if not block_hashes or not rids:
            return {rid: 0 for rid in rids}
        pipe = self.client.pipeline(transaction=False)
        for rid in rids:
            for tier in TIERS:
                pipe.smismember(f"{self._replica(rid)}:blocks:{tier}", block_hashes)
        found = iter(pipe.execute())
        return {rid: _leading(next(found), next(found)) for rid in rids}

    def blocks(self, replica_id: str, tier: str) -> set[str]:
        members = self.client.smembers(f"{self._replica(replica_id)}:blocks:{tier}")
        return {h.decode() for h in members}

    def requests(self, replica_id: str) -> dict[str, int]:
        raw = self.client.hgetall(f"{self._replica(replica_id)}:requests")
        return {k.decode(): int(v) for k, v in raw.items()}

    def delete_all(self) -> int:
        """Remove every key of this deployment (`kvserve down`); returns how many."""
        return _delete(self.client, self.client.scan_iter(match=f"{self.ns}:*", count=500))


def _leading(*tiers: list[int]) -> int:
    count = 0
    for held in zip(*tiers, strict=True):
        if not any(held):
            break
        count += 1
    return count


def _delete(client: redis.Redis, keys: Iterable[bytes]) -> int:
    batch, total = [], 0
    for key in keys:
        batch.append(key)
        if len(batch) == 500:
            total += client.delete(*batch)
            batch.clear()
    return total + (client.delete(*batch) if batch else 0)
