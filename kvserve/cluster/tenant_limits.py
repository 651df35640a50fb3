"""Per-tenant limits: requests per second and tokens per minute, for one application.

`TenantLimiter` is the logic (no Ray): a token bucket per tenant for requests (its burst is one
second's worth, at least 1 request) and a 60-second sliding window of the tokens (prompt +
completion) its finished requests used. A request is refused while the window is at or over
the tenant's `tokens_per_min`: a request's tokens are known only once it finished, so the one
that crosses the line is served and the next ones wait (what OpenAI's own token limits do).

One limiter per application, in a named actor (`limiter`), so the budget is the tenant's across
replicas, proxies and both protocols: the gRPC proxy asks it before it forwards a request, a
replica asks it for HTTP requests, and every replica reports the tokens each request used.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from kvserve.cluster.auth import Tenant

WINDOW_S = 60.0
NAMESPACE = "kvserve"


@dataclass(frozen=True)
class Refusal:
    tenant: str
    limit: str  # "requests_per_s" or "tokens_per_min"
    value: float
    retry_after_s: float

    def message(self) -> str:
        return (f"tenant {self.tenant!r} is over its limit {self.limit}={self.value:g}; "
                f"retry in {self.retry_after_s:.1f} s")


class TenantLimiter:
    def __init__(self, tenants: dict[str, Tenant],
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.tenants: dict[str, Tenant] = {}
        self._bucket: dict[str, tuple[float, float]] = {}  # tenant -> (level, at)
        self._used: dict[str, deque[tuple[float, int]]] = {}  # tenant -> (at, tokens)
        self.configure(tenants)

    def configure(self, tenants: dict[str, Tenant]) -> None:
        """New limits (a redeploy); what each tenant used so far still counts."""
        self.tenants = dict(tenants)

    def admit(self, tenant: str) -> Refusal | None:
        """Take one request from `tenant`'s budget, or say which limit refuses it."""
        limits = self.tenants.get(tenant)
        if limits is None:
            return None
        now = self.clock()
        if limits.tokens_per_min is not None:
            used = self._window(tenant, now)
            if sum(n for _, n in used) >= limits.tokens_per_min:
                return Refusal(tenant, "tokens_per_min", limits.tokens_per_min,
                               max(0.0, used[0][0] + WINDOW_S - now))
        rate = limits.requests_per_s
        if rate is not None:
            burst = max(1.0, rate)
            level, at = self._bucket.get(tenant, (burst, now))
            level = min(burst, level + (now - at) * rate)
            if level < 1.0:
                self._bucket[tenant] = (level, now)
                return Refusal(tenant, "requests_per_s", rate, (1.0 - level) / rate)
            self._bucket[tenant] = (level - 1.0, now)
        return None

    def record(self, tenant: str, tokens: int) -> None:
        """A finished request of `tenant` used `tokens` (prompt + completion)."""
        if tenant in self.tenants and self.tenants[tenant].tokens_per_min is not None:
            self._window(tenant, self.clock()).append((self.clock(), tokens))

    def _window(self, tenant: str, now: float) -> deque[tuple[float, int]]:
        used = self._used.setdefault(tenant, deque())
        while used and used[0][0] <= now - WINDOW_S:
            used.popleft()
        return used


def actor_name(app: str) -> str:
    return f"kvserve-limits:{app}"


def limiter(app: str, tenants: dict[str, Tenant] | None = None):  # -> ray ActorHandle
    """The application's limiter actor, started on first use (detached: it outlives the
    replica that started it; `stop_limiter` ends it with the app). `tenants` (re)configures it."""
    import ray

    actor = ray.remote(num_cpus=0)(TenantLimiter).options(
        name=actor_name(app), namespace=NAMESPACE, lifetime="detached",
        get_if_exists=True,
        # not in the placement group of the replica starting it (a tensor-parallel one's)
        scheduling_strategy="DEFAULT").remote(tenants or {})
    if tenants is not None:
        ray.get(actor.configure.remote(tenants))
    return actor


def existing_limiter(app: str):  # -> ray ActorHandle | None
    import ray

    try:
        return ray.get_actor(actor_name(app), namespace=NAMESPACE)
    except ValueError:
        return None


def stop_limiter(app: str) -> None:
    import ray

    actor = existing_limiter(app)
    if actor is not None:
        ray.kill(actor)
