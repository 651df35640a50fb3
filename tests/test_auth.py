"""API keys and tenant limits, the pure logic (kvserve/cluster/auth.py,
kvserve/cluster/tenant_limits.py)."""

from __future__ import annotations

import asyncio
import json

import pytest

from kvserve.cluster.auth import (
    AuthError,
    Gate,
    KeyRing,
    RateLimited,
    Tenant,
    digest,
    load_key_ring,
)
from kvserve.cluster.tenant_limits import TenantLimiter


def test_keys_from_flags_env_and_file_name_their_tenants(tmp_path):
    path = tmp_path / "keys.yaml"
    path.write_text("tenants:\n  acme: {requests_per_s: 2, tokens_per_min: 100}\n"
                    "keys:\n  - {key: sk-file, tenant: acme}\n  - sk-alone\n")
    ring = load_key_ring(["sk-flag:acme", "sk-own"], path, env={"KVSERVE_API_KEYS": "sk-env:b"})
    assert ring.authenticate("Bearer sk-flag").name == "acme"
    assert ring.authenticate("bearer sk-file").requests_per_s == 2
    assert ring.authenticate("Bearer sk-env").name == "b"
    own, alone = ring.authenticate("Bearer sk-own"), ring.authenticate("Bearer sk-alone")
    assert own.name.startswith("key-") and own.name != alone.name  # each its own tenant
    assert "sk-" not in ring.to_json() and digest("sk-own") in ring.to_json()
    assert KeyRing.from_json(ring.to_json()) == ring


@pytest.mark.parametrize("header", [None, "", "sk-flag", "Bearer sk-nope", "Basic sk-flag",
                                    "Bearer "])
def test_a_missing_malformed_or_unknown_key_is_refused_without_repeating_it(header):
    ring = load_key_ring(["sk-flag"], env={})
    with pytest.raises(AuthError) as err:
        ring.authenticate(header)
    assert "sk-" not in str(err.value)


def test_no_keys_means_open():
    ring = load_key_ring([], env={})
    assert ring.open and ring.authenticate(None) is None


@pytest.mark.parametrize("text, says", [
    ("keys: [{tenant: x}]", r"keys\[0\]"),
    ("tenants:\n  x: {rps: 1}\nkeys: [{key: k, tenant: x}]", "unknown limits"),
    ("tenants:\n  x: {requests_per_s: 0}\nkeys: [{key: k, tenant: x}]", "> 0"),
    ("tenants:\n  ghost: {requests_per_s: 1}\nkeys: [k]", "ghost"),
    ("- k", "mappings"),
])
def test_a_bad_keys_file_says_what_is_wrong(tmp_path, text, says):
    path = tmp_path / "keys.yaml"
    path.write_text(text)
    with pytest.raises(ValueError, match=says):
        load_key_ring(keys_file=path, env={})


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_requests_per_second_is_a_bucket_with_one_seconds_burst():
    clock = Clock()
    limiter = TenantLimiter({"t": Tenant("t", requests_per_s=2)}, clock)
    assert [limiter.admit("t") for _ in range(2)] == [None, None]  # burst: one second's worth
    refusal = limiter.admit("t")
    assert refusal.limit == "requests_per_s" and refusal.retry_after_s == pytest.approx(0.5)
    clock.now += 0.5
    assert limiter.admit("t") is None and limiter.admit("t") is not None
    assert limiter.admit("other") is None  # a tenant without limits


def test_tokens_per_minute_refuses_once_the_window_is_spent_and_forgets_after_60s():
    clock = Clock()
    limiter = TenantLimiter({"t": Tenant("t", tokens_per_min=100)}, clock)
    assert limiter.admit("t") is None
    limiter.record("t", 60)
    clock.now += 10
    assert limiter.admit("t") is None  # 60 < 100: served, even if it crosses the line
    limiter.record("t", 50)
    refusal = limiter.admit("t")
    assert refusal.limit == "tokens_per_min" and refusal.retry_after_s == pytest.approx(50)
    clock.now += 50.01  # the first 60 tokens leave the window
    assert limiter.admit("t") is None


def test_the_gate_admits_only_tenants_within_their_limits():
    limiter = TenantLimiter({"slow": Tenant("slow", requests_per_s=0.01)})
    ring = load_key_ring(["sk-a:acme", "sk-s:slow"], env={})
    ring = KeyRing(ring.digests, {**ring.tenants, "slow": Tenant("slow", requests_per_s=0.01)})

    async def admit(tenant):
        return limiter.admit(tenant)

    gate = Gate(ring, admit)

    async def run():
        assert (await gate.admit("Bearer sk-s")).name == "slow"
        with pytest.raises(RateLimited, match="requests_per_s"):
            await gate.admit("Bearer sk-s")
        assert (await gate.admit("Bearer sk-s", limits=False)).name == "slow"
        assert (await gate.admit("Bearer sk-a")).name == "acme"

    asyncio.run(run())


def test_the_http_proxy_middleware_refuses_a_bad_key_without_forwarding():
    """kvserve/cluster/http_ingress.KeyCheck, as Serve's HTTP proxy runs it: 401 in OpenAI's shape
    and
    the app never called; a valid key, an open cluster and /health pass through."""
    from kvserve.cluster.http_ingress import KeyCheck

    forwarded: list[str] = []

    async def app(scope, receive, send):
        forwarded.append(scope["path"])

    def call(ring: KeyRing, path: str, key: str | None) -> list[dict]:
        async def rings():
            return ring

        sent: list[dict] = []

        async def send(message):
            sent.append(message)

        headers = [(b"authorization", f"Bearer {key}".encode())] if key else []
        scope = {"type": "http", "path": path, "headers": headers}
        asyncio.run(KeyCheck(app, rings)(scope, None, send))
        return sent

    ring = load_key_ring(["sk-a:acme"], env={})
    sent = call(ring, "/v1/completions", "sk-wrong")
    assert sent[0]["status"] == 401 and forwarded == []
    assert json.loads(sent[1]["body"])["error"]["code"] == "invalid_api_key"
    assert call(ring, "/v1/completions", None)[0]["status"] == 401 and forwarded == []
    call(ring, "/v1/completions", "sk-a")
    call(ring, "/health", None)
    call(load_key_ring([], env={}), "/v1/models", None)
    assert forwarded == ["/v1/completions", "/health", "/v1/models"]
