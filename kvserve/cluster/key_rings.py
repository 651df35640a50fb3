"""Where each application's key ring lives so that the gRPC proxy can check keys: Ray's GCS
key-value store, one entry per application, holding digests only (`KeyRing.to_json`).

A replica publishes its application's ring when it starts (all replicas of one application
load the same keys, so the last writer writes what the first did); the proxy reads it,
refreshing every `REFRESH_S`, so a redeploy with new keys applies within that. An
application that never published a ring (or published an empty one) is open, as one
configured without keys is.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from kvserve.cluster import ray_compat
from kvserve.cluster.auth import OPEN, Gate, KeyRing
from kvserve.cluster.tenant_limits import existing_limiter

NAMESPACE = "kvserve-auth"
REFRESH_S = 2.0


def publish(app: str, ring: KeyRing) -> None:
    ray_compat.kv_put(app.encode(), ring.to_json(), namespace=NAMESPACE)


def forget(app: str) -> None:
    """The application is gone: its ring and its limiter."""
    from kvserve.cluster.tenant_limits import stop_limiter

    ray_compat.kv_delete_prefix(app, namespace=NAMESPACE)
    stop_limiter(app)


def read(app: str) -> KeyRing:
    raw = ray_compat.kv_get(app.encode(), namespace=NAMESPACE)
    return OPEN if raw is None else KeyRing.from_json(raw.decode())


_all: tuple[float, KeyRing] | None = None


async def all_rings_gate() -> KeyRing:
    """Every application's ring merged (the HTTP proxy's check), re-read every REFRESH_S."""
    global _all
    now = time.monotonic()
    if _all is None or now - _all[0] >= REFRESH_S:
        _all = (now, await asyncio.to_thread(read_all))
    return _all[1]


def read_all() -> KeyRing:
    """The union of every published ring: a key valid for any application."""
    digests: dict[str, str] = {}
    tenants: dict = {}
    for raw in ray_compat.kv_get_prefix("", namespace=NAMESPACE):
        if raw is not None:
            ring = KeyRing.from_json(raw.decode())
            digests |= ring.digests
            tenants |= ring.tenants
    return KeyRing(digests, tenants)


class ProxyGates:
    """The gRPC proxy's gate per application: its ring, and its limiter actor for tenants
    with limits, each re-read every REFRESH_S."""

    def __init__(self) -> None:
        self._gates: dict[str, tuple[float, Gate]] = {}

    async def gate(self, app: str) -> Gate:
        now = time.monotonic()
        cached = self._gates.get(app)
        if cached is not None and now - cached[0] < REFRESH_S:
            return cached[1]
        ring, actor = await asyncio.to_thread(_ring_and_limiter, app)
        gate = Gate(ring, _admit_by(actor) if actor is not None else None)
        self._gates[app] = (now, gate)
        return gate


def _ring_and_limiter(app: str) -> tuple[KeyRing, Any]:
    ring = read(app)
    return ring, existing_limiter(app) if ring.limited else None


def _admit_by(actor: Any) -> Any:
    async def admit(tenant: str) -> Any:
        return await actor.admit.remote(tenant)

    return admit
