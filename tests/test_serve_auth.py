"""API keys and tenants (#18) on a real Serve deployment: the gRPC proxy refuses a call without
a valid key before it reaches a replica; HTTP answers 401; a tenant is its own prefix-cache
salt; a tenant over its limit is refused, on both protocols, while another is served."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import grpc
import pytest

from cluster.client import Client
from kvserve.v1 import generation_pb2 as pb
from tests.serving import serve_locally

USES_SHARED_RAY = "2"  # tests/serving.py: run with the modules of this group

pytestmark = pytest.mark.ray  # starts Ray, so also slow (tests/conftest.py)

KEYS = """\
tenants:
  slow: {requests_per_s: 0.02}
keys:
  - {key: sk-acme, tenant: acme}
  - {key: sk-bravo, tenant: bravo}
  - {key: sk-slow, tenant: slow}
"""
LONG = " ".join(f"Entry {i}: the ledger for account {i} balanced." for i in range(12))


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    path = tmp_path_factory.mktemp("keys") / "keys.yaml"
    path.write_text(KEYS)
    with serve_locally({"kv_cache_memory": "128MiB", "api_keys_file": str(path)}) as served:
        yield served


def _client(served, key: str | None) -> Client:
    return Client(served.target, application=served.app, api_key=key)


def _generate(served, key: str | None, prompt: str = "Hello", max_tokens: int = 2
              ) -> list[pb.GenerateResponse]:
    with _client(served, key) as client:
        return list(client.generate(prompt, max_tokens=max_tokens, temperature=0))


def _http(served, key: str | None, body: dict) -> tuple[int, dict]:
    headers = {"Content-Type": "application/json"}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    request = urllib.request.Request(f"{served.http_url}/v1/completions",
                                     data=json.dumps(body).encode(), headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def test_no_key_or_a_wrong_one_never_reaches_the_engine(served):
    before = served.handle.request_counts.remote().result()
    for key in (None, "sk-wrong"):
        with pytest.raises(grpc.RpcError) as err:
            _generate(served, key)
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert "sk-" not in err.value.details()
        with pytest.raises(grpc.RpcError) as err:
            _client(served, key).model_info()
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        status, body = _http(served, key, {"prompt": "Hello", "max_tokens": 2})
        assert status == 401 and body["error"]["code"] == "invalid_api_key"
    after = served.handle.request_counts.remote().result()
    assert after == before, "a call without a valid key reached the replica or its engine"
    assert _generate(served, "sk-acme")[-1].finish_reason == pb.FINISH_REASON_LENGTH
    status, _ = _http(served, "sk-acme", {"prompt": "Hello", "max_tokens": 2})
    assert status == 200
    now = served.handle.request_counts.remote().result()
    assert now == {"generate_calls": before["generate_calls"] + 1,
                   "engine_requests": before["engine_requests"] + 2}


def test_tenants_hit_their_own_cached_prefix_and_never_another_tenants(served):
    def cached(key: str) -> int:
        return _generate(served, key, LONG)[-1].usage.cached_tokens

    assert cached("sk-acme") == 0
    assert cached("sk-bravo") == 0  # the same prompt, another tenant
    assert cached("sk-acme") > 0 and cached("sk-bravo") > 0
    status, body = _http(served, "sk-bravo", {"prompt": LONG, "max_tokens": 2})
    assert status == 200 and body["usage"]["prompt_tokens_details"]["cached_tokens"] > 0


def test_a_tenant_over_its_limit_is_refused_on_both_protocols_while_another_is_served(served):
    _generate(served, "sk-slow")  # its one request for the next 50 s
    before = served.handle.request_counts.remote().result()
    with pytest.raises(grpc.RpcError) as err:
        _generate(served, "sk-slow")
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "requests_per_s" in err.value.details()
    assert served.handle.request_counts.remote().result() == before  # refused at the proxy
    status, body = _http(served, "sk-slow", {"prompt": "Hello", "max_tokens": 2})
    assert status == 429 and body["error"]["param"] == "requests_per_s"  # one budget
    assert _generate(served, "sk-acme")[-1].finish_reason == pb.FINISH_REASON_LENGTH
