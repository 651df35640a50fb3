"""The cluster-wide KV index in Redis, one namespace per deployment.

Key schema (`{ns}` is `kvserve:{deployment}`); every per-replica key carries the replica's lease
TTL, renewed by each report, so a dead replica's entries vanish within the TTL:

    {ns}:replicas                       set    replica ids that ever reported (pruned on read)
    {ns}:replica:{rid}                  hash   device_total, device_used, device_cached,
                                               host_total, host_used, updated_at   (TTL)
    {ns}:replica:{rid}:blocks:{tier}    set    hex block hashes cached there, tier device|host
                                                                                   (TTL)
    {ns}:replica:{rid}:requests         hash   request id -> blocks held            (TTL)

Writes are pipelined (one round trip per report). `holders(block_hash)` asks each live replica's
sets, which is cheap for the handful of replicas a deployment has.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass

import redis

TIERS = ("device", "host")


@dataclass
class ReplicaUsage:
    device_total: int
    device_used: int
    device_cached: int
    host_total: int = 0
    host_used: int = 0


@dataclass
class ReplicaReport:
    """A replica's batched events since its last report (never sent per token)."""

    replica_id: str
    usage: ReplicaUsage
    stored: dict[str, list[str]]  # tier -> block hashes (hex) now cached there
    removed: dict[str, list[str]]  # tier -> block hashes gone from there
    requests_started: dict[str, int]  # request id -> blocks
    requests_finished: list[str]


class KVIndex:
    def __init__(self, client: redis.Redis, deployment: str, lease_ttl_s: float = 10.0) -> None:
        if lease_ttl_s <= 0:
            raise ValueError("lease_ttl_s must be positive")
        self.client = client
        self.ns = f"kvserve:{deployment}"
        self.lease_ms = int(lease_ttl_s * 1000)

    def _replica(self, rid: str) -> str:
        return f"{self.ns}:replica:{rid}"

    def apply(self, report: ReplicaReport) -> None:
        """Record a report and renew the replica's lease, in one pipelined round trip."""
        rid, key = report.replica_id, self._replica(report.replica_id)
        pipe = self.client.pipeline(transaction=True)
        pipe.sadd(f"{self.ns}:replicas", rid)
        pipe.hset(key, mapping={**asdict(report.usage), "updated_at": time.time()})
        for tier in TIERS:
            blocks = f"{key}:blocks:{tier}"
            if report.stored.get(tier):
                pipe.sadd(blocks, *report.stored[tier])
            if report.removed.get(tier):
                pipe.srem(blocks, *report.removed[tier])
        if report.requests_started:
            pipe.hset(f"{key}:requests", mapping=report.requests_started)
        if report.requests_finished:
            pipe.hdel(f"{key}:requests", *report.requests_finished)
        for suffix in ("", *(f":blocks:{t}" for t in TIERS), ":requests"):
            pipe.pexpire(key + suffix, self.lease_ms)
        pipe.execute()

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

    def requests(self, replica_id: str) -> dict[str, int]:
        raw = self.client.hgetall(f"{self._replica(replica_id)}:requests")
        return {k.decode(): int(v) for k, v in raw.items()}

    def drop_replica(self, replica_id: str) -> None:
        key = self._replica(replica_id)
        self.client.delete(key, *(f"{key}:blocks:{t}" for t in TIERS), f"{key}:requests")
        self.client.srem(f"{self.ns}:replicas", replica_id)

    def delete_all(self) -> int:
        """Remove every key of this deployment (`kvserve down`); returns how many."""
        return _delete(self.client, self.client.scan_iter(match=f"{self.ns}:*", count=500))


def _delete(client: redis.Redis, keys: Iterable[bytes]) -> int:
    batch, total = [], 0
    for key in keys:
        batch.append(key)
        if len(batch) == 500:
            total += client.delete(*batch)
            batch.clear()
    return total + (client.delete(*batch) if batch else 0)
