"""The Ray Serve application over real Ray (local) and Ray Serve's own gRPC proxy."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import grpc
import openai
import pytest
from pydantic import ValidationError

from kvserve.cluster.app import AppConfig
from kvserve.cluster.client import Client
from kvserve.v1 import generation_pb2 as pb
from tests.helpers import poll, solo_ids_each
from tests.serving import Served, serve_locally

USES_SHARED_RAY = "2"  # tests/serving.py: run with the modules of this group

pytestmark = pytest.mark.ray  # starts Ray, so also slow (tests/suite_plugin.py)


KEYS = """\
tenants:
  slow: {requests_per_s: 0.02}
keys:
  - {key: sk-acme, tenant: acme}
  - {key: sk-bravo, tenant: bravo}
  - {key: sk-slow, tenant: slow}
"""


@pytest.fixture(scope="module")
def served(tmp_path_factory) -> Served:
    # two sequences at a time, so that a third request waits (the waiting gauge is exercised)
    # a deep queue: the cancel tests offer far more than 2 streams at once
    # API keys: every test calls with tenant acme's key (`served.api_key`), but the
    # key tests at the end
    keys = tmp_path_factory.mktemp("keys") / "keys.yaml"
    keys.write_text(KEYS)
    # prompt-lookup speculation on: set in AppConfig, it must reach the replica's engine
    # and its metrics, and change no greedy token the tests below compare
    with serve_locally({"kv_cache_memory": "256MiB", "max_num_seqs": 2,
                        "max_waiting_requests": 64, "api_keys_file": str(keys),
                        "speculative_method": "ngram", "prompt_lookup_min": 1}) as served:
        served.api_key = "sk-acme"
        yield served


def test_concurrent_streams_equal_the_in_process_engine(served, real_engine):
    prompts = ["The capital of France is", "def add(a, b):", "Once upon a time", "1, 2, 3,"]
    expected = solo_ids_each(real_engine, [
        {"prompt": p, "params": {"temperature": 0, "max_tokens": 16}} for p in prompts])
    with ThreadPoolExecutor(len(prompts)) as pool:
        results = list(pool.map(lambda p: served.stream(p, temperature=0, max_tokens=16), prompts))
    for responses, want in zip(results, expected, strict=True):
        assert [t for r in responses for t in r.token_ids] == want
        assert responses[-1].finish_reason == pb.FINISH_REASON_LENGTH


def test_bad_input_is_invalid_argument_through_the_proxy(served):
    with pytest.raises(grpc.RpcError) as err:
        served.stream("hi", top_p=1.5)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "top_p" in err.value.details()
    assert served.stream("hi", max_tokens=2)[-1].finish_reason == pb.FINISH_REASON_LENGTH


def test_cancelled_stream_frees_its_blocks_on_the_replica(served):
    stub, handle = served.stub, served.handle
    call = stub.Generate(
        pb.GenerateRequest(
            prompt="Count to a thousand:",
            params=pb.SamplingParams(max_tokens=1000, ignore_eos=True),
        ),
        metadata=served.metadata,
    )
    next(call)
    assert handle.kv_cache_usage.remote().result() > 0
    call.cancel()
    assert _wait_kv_free(handle) == 0  # at the next step: not after its 1000 tokens


def test_model_info_through_the_proxy(served):
    stub = served.stub
    info = stub.ModelInfo(pb.ModelInfoRequest(), metadata=served.metadata)
    assert (info.model, info.replicas, info.vocab_size) == ("SmolLM2-135M-Instruct", 1, 49152)


def test_serve_runs_the_deployment_with_the_app_configs_shutdown_settings(served):
    """What `build_app` passes reaches Serve's controller. A stopping replica sleeps
    `graceful_shutdown_wait_loop_s` before it first looks for open streams: with Serve's default
    (2 s) every replica stop, idle or not, took 2 s (each rollout, scale-in and `kvserve down`)."""
    from kvserve.cluster import ray_compat

    apps = ray_compat.serve_details()["applications"]
    config = apps[served.app]["deployments"]["Generation"]["deployment_config"]
    assert config["graceful_shutdown_wait_loop_s"] == 0.5
    assert config["graceful_shutdown_timeout_s"] == AppConfig().graceful_shutdown_timeout_s


def test_app_config_rejects_unknown_and_bad_fields():
    with pytest.raises(ValidationError, match="replicaz"):
        AppConfig.model_validate({"replicaz": 2})
    with pytest.raises(ValidationError, match="replicas"):
        AppConfig.model_validate({"replicas": 0})


def test_app_config_engine_settings_reach_the_replicas_engine_config():
    from kvserve.workers.config import EngineConfig

    settings = {"dtype": "bfloat16", "device": "cuda:1", "attention_backend": "flash_attn",
                "block_size": 512, "max_model_len": 4096, "gpu_memory_utilization": 0.8,
                "rope_parameters": {"rope_type": "yarn", "factor": 2.0}}
    engine = EngineConfig(**AppConfig.model_validate(settings).engine_config())
    assert {k: getattr(engine, k) for k in settings} == settings


def test_app_config_defaults_are_the_engines_but_for_the_pool_and_prefix_caching():
    from kvserve.workers.config import EngineConfig

    served = EngineConfig(**AppConfig().engine_config())
    assert served == EngineConfig(kv_cache_memory="1GiB", enable_prefix_caching=True)


@pytest.mark.parametrize("settings, field", [
    ({"dtype": "fp8"}, "dtype"),
    ({"attention_backend": "xformers"}, "attention_backend"),
    ({"device": "tpu9"}, "device"),
    ({"block_size": 0}, "block_size"),
    ({"max_model_len": 0}, "max_model_len"),
    ({"gpu_memory_utilization": 1.5}, "gpu_memory_utilization"),
    ({"rope_parameters": "yarn"}, "rope_parameters"),
    ({"kv_cache_memory": "lots"}, "kv_cache_memory"),
    ({"health_check_period_s": 0}, "health_check_period_s"),
    ({"attention_backend": "flash_attn", "device": "cpu"}, "attention_backend"),
    ({"attention_backend": "flash_attn", "block_size": 16}, "block_size"),
])
def test_app_config_rejects_bad_engine_settings_naming_the_field(settings, field):
    with pytest.raises(ValidationError, match=field):
        AppConfig.model_validate(settings)


def test_async_client_streams_and_reports_errors(served):
    import asyncio

    from kvserve.cluster.client import AsyncClient

    target = served.target

    async def scenario() -> None:
        async with AsyncClient(target, application=served.app, api_key=served.api_key) as client:
            chunks = [c async for c in client.generate("Hello", max_tokens=5, temperature=0)]
            assert sum(len(c.token_ids) for c in chunks) == 5
            assert (await client.model_info()).replicas == 1
            with pytest.raises(grpc.aio.AioRpcError) as err:
                async for _ in client.generate(prompt_token_ids=[1, 10**9]):
                    pass
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "prompt_token_ids" in err.value.details()

    asyncio.run(scenario())


def _nonzero(families: dict[str, list[tuple[str, float]]], metric: str) -> bool:
    """The exact Prometheus names the Grafana dashboard queries (histograms via _count)."""
    samples = families.get(f"ray_{metric}", []) + families.get(f"ray_{metric}_count", [])
    return any(value > 0 for _, value in samples)


def test_prometheus_endpoint_exposes_every_metric_during_traffic(served):
    from kvserve.cluster.metrics import METRIC_NAMES

    stub = served.stub
    assert served.stream("Hi", max_tokens=3)[-1].finish_reason  # a finished request
    long = pb.GenerateRequest(
        prompt="Tell me a long story.", params=pb.SamplingParams(max_tokens=2000, ignore_eos=True)
    )
    # a greedy request that repeats its prompt: its drafts are accepted (the spec_decode metrics)
    quote = pb.GenerateRequest(
        prompt="Repeat this line ten times: the red fox and the blue owl sat by the old mill.",
        params=pb.SamplingParams(max_tokens=2000, ignore_eos=True, temperature=0))
    calls = [stub.Generate(r, metadata=served.metadata) for r in (long, quote)]
    next(calls[0]), next(calls[1])  # both admitted (max_num_seqs 2) before a third is sent:
    calls.append(stub.Generate(long, metadata=served.metadata))  # it waits behind them (had it
    # been admitted first, one of the streams read below would wait for a 2,000-token request)
    missing: list[str] = list(METRIC_NAMES)
    deadline = time.monotonic() + 60
    try:
        while missing and time.monotonic() < deadline:
            for _ in range(5):
                next(calls[0]), next(calls[1])  # keep tokens (and so the gauges) moving
            families = served.metrics()
            missing = [m for m in METRIC_NAMES if not _nonzero(families, m)]
    finally:
        for call in calls:
            call.cancel()
    assert not missing, f"metrics absent or zero: {missing}"


def _wait_kv_free(handle, timeout: float = 5.0) -> float:
    """The replica's KV usage once it is 0, or after `timeout`. An abort frees a request's
    blocks at the next step boundary, and on a loaded 2-core host a step in flight can take ~2 s;
    a stream the abort missed holds its blocks until its hundreds of `max_tokens` are decoded
    (at >= 20 ms a token, well past 5 s), so the tests below still fail on a missed abort."""
    return poll(lambda: handle.kv_cache_usage.remote().result(), lambda u: u == 0, timeout, 0.05)


def test_50_random_cancels_leave_kv_usage_at_zero(served):
    import random

    request = pb.GenerateRequest(
        prompt="Write a very long essay about the sea.",
        params=pb.SamplingParams(max_tokens=400, ignore_eos=True),
    )

    def read_then_cancel(tokens: int) -> None:
        call = served.stub.Generate(request, metadata=served.metadata)
        for _ in range(tokens):
            next(call)
        call.cancel()

    rng = random.Random(0)
    with ThreadPoolExecutor(10) as pool:  # waves of 10 concurrent streams, cancelled at random
        for _ in range(5):
            list(pool.map(read_then_cancel, [rng.randint(0, 3) for _ in range(10)]))
    assert _wait_kv_free(served.handle) == 0
    assert served.stream("hi", max_tokens=2)[-1].finish_reason == pb.FINISH_REASON_LENGTH


def test_deadline_exceeded_aborts_the_request_and_frees_its_blocks(served):
    request = pb.GenerateRequest(
        prompt="Count to a million:", params=pb.SamplingParams(max_tokens=3000, ignore_eos=True)
    )
    start = time.monotonic()
    with pytest.raises(grpc.RpcError) as err:
        for _ in served.stub.Generate(request, metadata=served.metadata, timeout=2.0):
            pass
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert time.monotonic() - start < 10
    assert _wait_kv_free(served.handle) == 0


# --- the OpenAI-compatible HTTP API behind Serve's HTTP proxy --------------------------------

def _openai(served: Served, api_key: str | None = None) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{served.http_url}/v1", api_key=api_key or served.api_key,
                         max_retries=0)


def test_greedy_is_the_same_tokens_over_http_grpc_and_in_process(served, real_engine):
    """The exactness prompts (tests/prompts.py), greedy: token ids over HTTP (vLLM's
    `return_tokens_as_token_ids`), over gRPC and in-process are one list. All but the
    1,500-token one, whose three prefills (one in-process, one per protocol) cost ~12 CPU-s of
    the suite: prompts prefilled in more than one chunk through the service are
    tests/test_serve_cache.py's chats (~600 tokens and more, in 512-token chunks), and each
    protocol's path is the same whatever the prompt's length."""
    from tests.prompts import varied_prompts

    prompts = [ids for name, ids in varied_prompts(real_engine.tokenizer).items()
               if name != "long_1500"]
    assert len(prompts) == 12
    expected = solo_ids_each(real_engine, [
        {"prompt_token_ids": ids, "params": {"temperature": 0, "max_tokens": 16}}
        for ids in prompts])
    client = _openai(served)

    def over_http(ids: list[int]) -> list[int]:
        reply = client.completions.create(
            model="SmolLM2-135M-Instruct", prompt=ids, temperature=0, max_tokens=16,
            logprobs=0, extra_body={"return_tokens_as_token_ids": True})
        return [int(t.removeprefix("token_id:")) for t in reply.choices[0].logprobs.tokens]

    def over_grpc(ids: list[int]) -> list[int]:
        request = pb.GenerateRequest(prompt_token_ids=pb.TokenIds(ids=ids),
                                     params=pb.SamplingParams(temperature=0, max_tokens=16))
        return [t for r in served.stub.Generate(request, metadata=served.metadata)
                for t in r.token_ids]

    with ThreadPoolExecutor(4) as pool:
        http = list(pool.map(over_http, prompts))
        grpc_ids = list(pool.map(over_grpc, prompts))
    assert http == expected
    assert grpc_ids == expected


def test_openai_sdk_streams_chat_through_the_http_proxy(served):
    client = _openai(served)
    messages = [{"role": "user", "content": "Say hello."}]
    chunks = list(client.chat.completions.create(
        model="SmolLM2-135M-Instruct", messages=messages, temperature=0, max_tokens=8,
        stream=True, stream_options={"include_usage": True}))
    whole = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=messages,
                                           temperature=0, max_tokens=8)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) \
        == whole.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=messages,
                                       top_p=1.5)
    assert err.value.body["param"] == "top_p"
    assert [m.id for m in client.models.list().data] == ["SmolLM2-135M-Instruct"]
    with urllib.request.urlopen(f"{served.http_url}/health", timeout=10) as response:
        assert response.status == 200


def test_http_client_that_disconnects_mid_stream_frees_its_blocks_on_the_replica(served):
    """As a gRPC cancel does: the proxy cancels the replica's task, the engine request is
    aborted, its KV blocks are freed within a second."""
    import socket
    from urllib.parse import urlparse

    url = urlparse(served.http_url)
    body = json.dumps({"prompt": "Count to a thousand:", "max_tokens": 1000,
                       "ignore_eos": True, "stream": True}).encode()
    with socket.create_connection((url.hostname, url.port)) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                     b"application/json\r\nAuthorization: Bearer sk-acme\r\n"
                     b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        seen = b""
        while seen.count(b"data: ") < 2:
            seen += sock.recv(4096)
        assert served.handle.kv_cache_usage.remote().result() > 0
    assert _wait_kv_free(served.handle) == 0


# --- API keys and tenants: both protocols on this deployment --------------------------------

LONG = " ".join(f"Entry {i}: the ledger for account {i} balanced." for i in range(12))


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
    with pytest.raises(openai.AuthenticationError):  # what the official SDK raises
        _openai(served, "sk-wrong").completions.create(model="SmolLM2-135M-Instruct",
                                                       prompt="Hello", max_tokens=2)
    after = served.handle.request_counts.remote().result()
    assert after == before, "a call without a valid key reached the replica or its engine"
    assert _generate(served, "sk-acme")[-1].finish_reason == pb.FINISH_REASON_LENGTH
    status, _ = _http(served, "sk-acme", {"prompt": "Hello", "max_tokens": 2})
    assert status == 200
    now = served.handle.request_counts.remote().result()
    assert now == {"generate_calls": before["generate_calls"] + 1,
                   "http_requests": before["http_requests"] + 1,
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
    with pytest.raises(openai.RateLimitError) as limited:  # one budget for both protocols
        _openai(served, "sk-slow").completions.create(model="SmolLM2-135M-Instruct",
                                                      prompt="Hello", max_tokens=2)
    assert limited.value.body["param"] == "requests_per_s"
    assert int(limited.value.response.headers["retry-after"]) >= 1
    assert _generate(served, "sk-acme")[-1].finish_reason == pb.FINISH_REASON_LENGTH
