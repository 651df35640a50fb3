"""API keys and tenants: who may call the service, and whose prefix cache a request may share.

Keys come from `--api-key KEY[:TENANT]` (repeatable), `KVSERVE_API_KEYS` (comma-separated
`KEY[:TENANT]`) or a keys file (YAML, `keys_file_format` below). A key's tenant is its default
prefix-cache salt, so tenants never share cached blocks unless they send the same `cache_salt`
on purpose; a key that names no tenant is its own tenant (`key-` + 8 hex digits of its digest).
Each tenant may have limits: requests per second and tokens (prompt + completion) per minute.

Why digests: the ring holds SHA-256 digests, never keys, so what is shared with the gRPC proxy
(Ray's key-value store) or printed by a debugger cannot be replayed; a presented key is hashed
and compared with every digest with `hmac.compare_digest`, so the time taken says nothing about
how much of a key matched, or which key.

With no keys configured the service is open. No Ray, gRPC or HTTP here: both
ingress paths (the gRPC proxy, the replicas' HTTP app) call `authenticate`.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import yaml

KEYS_ENV = "KVSERVE_API_KEYS"
BEARER = "bearer "

keys_file_format = """\
# kvserve API keys: each key names its tenant (optional); tenants may have limits
tenants:
  acme: {requests_per_s: 5, tokens_per_min: 20000}
keys:
  - {key: sk-acme-1, tenant: acme}
  - sk-solo            # its own tenant, no limits
"""


class AuthError(Exception):
    """A request without a valid key: gRPC UNAUTHENTICATED, HTTP 401. The message never
    repeats the key."""


@dataclass(frozen=True)
class Tenant:
    name: str
    requests_per_s: float | None = None  # None: no limit
    tokens_per_min: float | None = None

    @property
    def limited(self) -> bool:
        return self.requests_per_s is not None or self.tokens_per_min is not None


def digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def _own_tenant(key_digest: str) -> str:
    return f"key-{key_digest[:8]}"


@dataclass(frozen=True)
class KeyRing:
    """Key digest -> tenant name, and the tenants. Empty: the service is open."""

    digests: dict[str, str]
    tenants: dict[str, Tenant]

    @property
    def open(self) -> bool:
        return not self.digests

    @property
    def limited(self) -> bool:
        """Whether any tenant has a limit (then the application needs its limiter)."""
        return any(t.limited for t in self.tenants.values())

    def authenticate(self, authorization: str | None) -> Tenant | None:
        """The tenant of `authorization` ("Bearer KEY"); None when the ring is open; raises
        AuthError for a missing, malformed or unknown key."""
        if self.open:
            return None
        if not authorization:
            raise AuthError("missing API key: send the header 'Authorization: Bearer KEY'")
        if not authorization[:len(BEARER)].lower() == BEARER:
            raise AuthError("malformed Authorization: expected 'Bearer KEY'")
        presented = digest(authorization[len(BEARER):].strip()).encode()
        found = None
        for known, tenant in self.digests.items():  # every digest, no early exit
            if hmac.compare_digest(presented, known.encode()):
                found = tenant
        if found is None:
            raise AuthError("invalid API key")
        return self.tenants[found]

    def to_json(self) -> str:
        """Digests and tenants (no key): what the gRPC proxy reads."""
        return json.dumps({"digests": self.digests,
                           "tenants": {n: asdict(t) for n, t in self.tenants.items()}})

    @classmethod
    def from_json(cls, text: str) -> KeyRing:
        data = json.loads(text)
        return cls(dict(data["digests"]),
                   {n: Tenant(**t) for n, t in data["tenants"].items()})


OPEN = KeyRing({}, {})


def parse_key(spec: str) -> tuple[str, str | None]:
    """`KEY` or `KEY:TENANT` -> (key, tenant or None)."""
    key, _, tenant = spec.strip().partition(":")
    if not key:
        raise ValueError("an API key must not be empty")
    return key, tenant or None


def load_key_ring(keys: Iterable[str] = (), keys_file: str | Path | None = None,
                  env: dict[str, str] | None = None) -> KeyRing:
    """Every key from `keys` (`KEY[:TENANT]`), $KVSERVE_API_KEYS and `keys_file`."""
    env = os.environ if env is None else env
    specs = [parse_key(k) for k in keys]
    specs += [parse_key(k) for k in env.get(KEYS_ENV, "").split(",") if k.strip()]
    limits: dict[str, dict[str, Any]] = {}
    if keys_file is not None:
        file_specs, limits = _read_keys_file(Path(keys_file))
        specs += file_specs
    digests: dict[str, str] = {}
    for key, tenant in specs:
        d = digest(key)
        digests[d] = tenant or _own_tenant(d)
    unknown = set(limits) - set(digests.values())
    if unknown:
        raise ValueError(f"keys file: limits for tenants no key names: {sorted(unknown)}")
    tenants = {name: Tenant(name, **limits.get(name, {})) for name in set(digests.values())}
    return KeyRing(digests, tenants)


def _read_keys_file(path: Path) -> tuple[list[tuple[str, str | None]], dict[str, dict]]:
    data = yaml.safe_load(path.read_text()) or {}
    if not isinstance(data, dict) or set(data) - {"keys", "tenants"}:
        raise ValueError(f"{path}: expected the mappings 'keys' and 'tenants', as in:\n"
                         f"{keys_file_format}")
    specs: list[tuple[str, str | None]] = []
    for i, entry in enumerate(data.get("keys") or []):
        if isinstance(entry, str):
            specs.append(parse_key(entry))
        elif isinstance(entry, dict) and isinstance(entry.get("key"), str):
            specs.append((entry["key"], entry.get("tenant")))
        else:
            raise ValueError(f"{path}: keys[{i}] must be a string or {{key, tenant}}")
    limits: dict[str, dict] = {}
    for name, values in (data.get("tenants") or {}).items():
        values = dict(values or {})
        bad = set(values) - {"requests_per_s", "tokens_per_min"}
        if bad:
            raise ValueError(f"{path}: tenants.{name}: unknown limits {sorted(bad)} "
                             "(requests_per_s, tokens_per_min)")
        for limit, value in values.items():
            if not isinstance(value, (int, float)) or value <= 0:
                raise ValueError(f"{path}: tenants.{name}.{limit} must be a number > 0")
        limits[str(name)] = values
    return specs, limits


class RateLimited(Exception):
    """A tenant over one of its limits: gRPC RESOURCE_EXHAUSTED, HTTP 429 (`refusal` names the
    limit and when to retry)."""

    def __init__(self, refusal: Any) -> None:
        super().__init__(refusal.message())
        self.refusal = refusal


class Gate:
    """What an ingress runs before any work is queued: authenticate, then (when the tenant has
    limits and `admit` is given) take one request from its budget. `admit(tenant)` returns a
    refusal or None (the application's limiter); without it, limits are someone else's job
    (a replica serving a gRPC request the proxy already admitted)."""

    def __init__(self, ring: KeyRing, admit: Any = None) -> None:
        self.ring = ring
        self._admit = admit

    @property
    def open(self) -> bool:
        return self.ring.open

    def tenant(self, authorization: str | None) -> Tenant | None:
        return self.ring.authenticate(authorization)

    async def admit(self, authorization: str | None, limits: bool = True) -> Tenant | None:
        """The caller's tenant (None when open); raises AuthError or RateLimited."""
        tenant = self.ring.authenticate(authorization)
        has_limits = tenant is not None and tenant.limited
        if limits and has_limits and self._admit is not None:
            refusal = await self._admit(tenant.name)
            if refusal is not None:
                raise RateLimited(refusal)
        return tenant


OPEN_GATE = Gate(OPEN)
