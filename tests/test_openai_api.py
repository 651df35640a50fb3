"""The OpenAI-compatible HTTP API over the real model, served by uvicorn on loopback and
called with the official `openai` package: the same FastAPI app every Serve replica mounts
(tests/test_serve_openai.py checks it behind Serve's proxy)."""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass

import openai
import pytest
import uvicorn

from kvserve.cluster.auth import OPEN_GATE, Gate, load_key_ring
from kvserve.cluster.local_head import free_port
from kvserve.cluster.openai.http import build_openai_app
from kvserve.cluster.openai.serving import OpenAIServing
from kvserve.cluster.tenant_limits import TenantLimiter
from kvserve.workers.async_engine import AsyncLLMEngine
from kvserve.workers.config import EngineConfig
from kvserve.workers.engine import LLMEngine
from tests.helpers import assert_engine_idle, poll, solo_ids
from tests.otlp import CALLER_SPAN_ID, CALLER_TRACE_ID, CALLER_TRACEPARENT, otlp_receiver

MESSAGES = [{"role": "user", "content": "Name three colours of the rainbow."}]
PROMPT = "The three primary colours are"


@dataclass
class Local:
    url: str  # http://127.0.0.1:PORT
    engine: LLMEngine
    client: openai.OpenAI


@contextlib.contextmanager
def http_server(engine: LLMEngine, gate: Gate = OPEN_GATE, on_usage=None,
                observe=None, tracer=None) -> Iterator[Local]:
    """`engine` behind the OpenAI app on uvicorn, in a thread; its AsyncLLMEngine is shut
    down (and must have left `engine` idle) when the block ends."""
    core = AsyncLLMEngine(engine)
    serving = OpenAIServing(core, on_usage=on_usage, observe=observe, tracer=tracer)
    app = build_openai_app(serving, on_shutdown=core.shutdown, gate=gate)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    poll(lambda: server.started, bool, timeout_s=30)
    url = f"http://127.0.0.1:{port}"
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    try:
        yield Local(url, engine, client)
    finally:
        server.should_exit = True
        thread.join(timeout=30)
    assert_engine_idle(engine)


@pytest.fixture(scope="module")
def local(real_engine) -> Iterator[Local]:
    with http_server(real_engine) as served:
        yield served


def get_json(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=30) as r:
        return json.loads(r.read())


def post_json(url: str, body: dict) -> dict:
    request = urllib.request.Request(url, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as r:
        return json.loads(r.read())


def greedy_ids(engine: LLMEngine, max_tokens: int, **prompt) -> list[int]:
    ids = engine.tokenize(**prompt)
    return solo_ids(engine, prompt_token_ids=ids, params={"temperature": 0,
                                                          "max_tokens": max_tokens})


@pytest.fixture(scope="module")
def references(real_engine) -> dict[str, list[int]]:
    """In-process greedy outputs, computed before the server owns the engine."""
    return {"chat": greedy_ids(real_engine, 24, messages=MESSAGES),
            "completion": greedy_ids(real_engine, 12, prompt=PROMPT)}


def test_chat_greedy_equals_the_engine_streamed_and_not(references, real_engine, local):
    want = references["chat"]
    text = real_engine.detokenize(want)
    reply = local.client.chat.completions.create(model="SmolLM2-135M-Instruct",
                                                 messages=MESSAGES, temperature=0,
                                                 max_tokens=24)
    assert reply.choices[0].message.content == text
    assert reply.choices[0].message.role == "assistant"
    assert reply.usage.completion_tokens == len(want)
    assert reply.usage.prompt_tokens == len(real_engine.tokenize(messages=MESSAGES))
    assert reply.choices[0].finish_reason == ("length" if len(want) == 24 else "stop")

    chunks = list(local.client.chat.completions.create(
        model="SmolLM2-135M-Instruct", messages=MESSAGES, temperature=0, max_tokens=24,
        stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(want)
    assert all(c.usage is None for c in chunks[:-1])
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] is not None


def test_completion_greedy_equals_the_engine_streamed_and_not(references, real_engine, local):
    want = references["completion"]
    text = real_engine.detokenize(want)
    reply = local.client.completions.create(model="SmolLM2-135M-Instruct", prompt=PROMPT,
                                            temperature=0, max_tokens=12)
    assert reply.choices[0].text == text and reply.usage.completion_tokens == len(want)
    stream = local.client.completions.create(model="SmolLM2-135M-Instruct", prompt=PROMPT,
                                             temperature=0, max_tokens=12, stream=True)
    assert "".join(c.choices[0].text for c in stream) == text
    echoed = local.client.completions.create(model="SmolLM2-135M-Instruct", prompt=PROMPT,
                                             temperature=0, max_tokens=12, echo=True)
    assert echoed.choices[0].text == PROMPT + text
    ids = real_engine.tokenize(prompt=PROMPT)  # a prompt of token ids gets the same tokens
    by_ids = local.client.completions.create(model="SmolLM2-135M-Instruct", prompt=ids,
                                             temperature=0, max_tokens=12)
    assert by_ids.choices[0].text == text


def test_a_seed_reproduces_a_sample_and_n_gives_n_choices(local):
    def sample(seed: int, n: int = 1) -> list[str]:
        reply = local.client.completions.create(model="SmolLM2-135M-Instruct", prompt=PROMPT,
                                                temperature=1.0, max_tokens=16, seed=seed, n=n)
        return [c.text for c in sorted(reply.choices, key=lambda c: c.index)]

    first = sample(7)
    assert sample(7) == first
    assert any(sample(s) != first for s in (8, 9, 10))  # control: the seed is what fixed it
    two = sample(7, n=2)
    assert two == first + sample(8)  # sample j is seeded seed + j


def test_logprobs_are_present_and_name_the_sampled_tokens(local):
    reply = local.client.chat.completions.create(
        model="SmolLM2-135M-Instruct", messages=MESSAGES, temperature=0, max_tokens=6,
        logprobs=True, top_logprobs=3)
    content = reply.choices[0].logprobs.content
    assert len(content) == reply.usage.completion_tokens
    assert "".join(e.token for e in content) == reply.choices[0].message.content
    for e in content:
        assert len(e.top_logprobs) == 3 and e.logprob <= 0
        assert e.top_logprobs[0].logprob == pytest.approx(e.logprob, abs=1e-5)  # greedy
    completion = local.client.completions.create(model="SmolLM2-135M-Instruct", prompt=PROMPT,
                                                 temperature=0, max_tokens=5, logprobs=2)
    lp = completion.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    assert all(len(top) == 2 for top in lp.top_logprobs)
    plain = local.client.completions.create(model="SmolLM2-135M-Instruct", prompt=PROMPT,
                                            temperature=0, max_tokens=5)
    assert plain.choices[0].logprobs is None  # control: only when asked


@pytest.mark.parametrize("kwargs, param", [
    ({"temperature": -1.0}, "temperature"),
    ({"top_p": 1.5}, "top_p"),
    ({"max_tokens": 10**6}, "max_tokens"),
    ({"extra_body": {"top_k": "many"}}, "top_k"),
    ({"logit_bias": {"42": 1.0}}, "logit_bias"),
    ({"prompt": []}, "prompt"),
    ({"prompt": [[]]}, "prompt"),
])
def test_a_bad_parameter_is_a_bad_request_naming_it(local, kwargs, param):
    with pytest.raises(openai.BadRequestError) as err:
        local.client.completions.create(model="SmolLM2-135M-Instruct",
                                        **{"prompt": PROMPT, "max_tokens": 4, **kwargs})
    assert err.value.status_code == 400
    assert err.value.body["param"] == param, err.value.body


def test_chat_errors_name_the_chat_fields(local):
    with pytest.raises(openai.BadRequestError) as err:
        local.client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=MESSAGES,
                                             max_completion_tokens=10**6)
    assert err.value.body["param"] == "max_completion_tokens"
    with pytest.raises(openai.BadRequestError) as err:
        local.client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=MESSAGES,
                                             logprobs=True, top_logprobs=50)
    assert err.value.body["param"] == "top_logprobs"
    with pytest.raises(openai.BadRequestError) as err:
        local.client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=[])
    assert err.value.body["param"] == "messages"
    with pytest.raises(openai.NotFoundError) as err:
        local.client.chat.completions.create(model="gpt-4o", messages=MESSAGES)
    assert err.value.body["param"] == "model" and err.value.body["code"] == "model_not_found"
    assert_engine_idle(local.engine)  # nothing refused left anything behind


def test_models_health_and_tokenize(local, real_engine):
    models = local.client.models.list()
    assert [m.id for m in models.data] == ["SmolLM2-135M-Instruct"]
    assert get_json(f"{local.url}/health") == {"status": "ok"}
    body = post_json(f"{local.url}/tokenize", {"prompt": PROMPT})
    assert body["tokens"] == real_engine.tokenize(prompt=PROMPT)
    assert body["count"] == len(body["tokens"]) and body["max_model_len"] > 0
    chat = post_json(f"{local.url}/tokenize", {"messages": MESSAGES})
    assert chat["tokens"] == real_engine.tokenize(messages=MESSAGES)


def test_a_client_that_disconnects_mid_stream_frees_its_request(local):
    """Read two events of a long stream, drop the connection: the request is aborted and its
    KV blocks freed long before its 1500 tokens would have been generated (~40 s)."""
    body = json.dumps({"prompt": PROMPT, "max_tokens": 1500, "ignore_eos": True,
                       "stream": True}).encode()
    port = int(local.url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                     b"application/json\r\nContent-Length: " + str(len(body)).encode()
                     + b"\r\n\r\n" + body)
        seen = b""
        while seen.count(b"data: ") < 2:
            seen += sock.recv(4096)
        assert b" 200 " in seen.split(b"\r\n")[0]
        assert local.engine.has_unfinished()
    started = time.monotonic()
    busy = poll(lambda: local.engine.has_unfinished(), lambda busy: not busy, timeout_s=10)
    assert not busy, "the request kept running after its client left"
    assert time.monotonic() - started < 10
    assert_engine_idle(local.engine)


def test_admission_refusal_is_429_with_retry_after(real_checkpoint):
    """One batch slot, one waiting place: a third concurrent request is refused with the
    SDK's RateLimitError, and the two admitted ones finish. The first runs 160 tokens (over
    1.5 s at the fastest decode these CPUs reach), so it is still running when the third comes
    0.6 s later."""
    engine = LLMEngine(EngineConfig(kv_cache_memory=64 * 1024**2, device="cpu", max_num_seqs=1,
                                    max_waiting_requests=1), checkpoint=real_checkpoint)
    with http_server(engine) as served:
        results: list = []

        def call() -> None:
            try:
                results.append(served.client.completions.create(
                    model="SmolLM2-135M-Instruct", prompt=PROMPT, max_tokens=160,
                    temperature=0, extra_body={"ignore_eos": True}))
            except openai.RateLimitError as exc:
                results.append(exc)

        threads = [threading.Thread(target=call) for _ in range(3)]
        for t in threads:
            t.start()
            time.sleep(0.3)
        for t in threads:
            t.join()
        refused = [r for r in results if isinstance(r, openai.RateLimitError)]
        assert len(refused) == 1, results
        assert refused[0].response.headers["retry-after"] == "1"
        assert refused[0].body["param"] == "max_waiting_requests"
        assert sum(1 for r in results if not isinstance(r, Exception)) == 2


# --- API keys and tenants ---------------------------------------------------------------------

LONG_PROMPT = " ".join(f"Line {i}: the quarterly ledger balanced to the cent." for i in range(12))


def test_keys_tenants_and_limits_over_http(real_checkpoint, tmp_path):
    """No key or a wrong one: 401 (the SDK's AuthenticationError) and nothing reaches the
    engine. Two tenants sending the same long prompt: each hits its own cached blocks, never
    the other's. A tenant over requests_per_s or tokens_per_min gets 429 naming the limit
    while another tenant is served."""
    keys = tmp_path / "keys.yaml"
    keys.write_text("tenants:\n  slow: {requests_per_s: 0.05}\n  thrifty: {tokens_per_min: 40}\n"
                    "keys:\n  - {key: sk-a, tenant: acme}\n  - {key: sk-b, tenant: bravo}\n"
                    "  - {key: sk-slow, tenant: slow}\n  - {key: sk-thrifty, tenant: thrifty}\n")
    ring = load_key_ring(keys_file=keys, env={})
    limiter = TenantLimiter(ring.tenants)

    async def admit(tenant: str):
        return limiter.admit(tenant)

    opened: list[int] = []

    def observe(stream):
        opened.append(1)
        return stream

    engine = LLMEngine(EngineConfig(kv_cache_memory=64 * 1024**2, device="cpu",
                                    enable_prefix_caching=True), checkpoint=real_checkpoint)
    with http_server(engine, gate=Gate(ring, admit), on_usage=limiter.record,
                     observe=observe) as served:
        def client(key: str) -> openai.OpenAI:
            return openai.OpenAI(base_url=f"{served.url}/v1", api_key=key, max_retries=0)

        def ask(key: str, prompt: str = PROMPT, max_tokens: int = 4):
            return client(key).completions.create(model="SmolLM2-135M-Instruct", prompt=prompt,
                                                  temperature=0, max_tokens=max_tokens)

        for bad in ("sk-wrong", "sk-"):
            with pytest.raises(openai.AuthenticationError) as err:
                ask(bad)
            assert err.value.status_code == 401 and "sk-" not in err.value.message
        with pytest.raises(urllib.error.HTTPError) as no_key:  # no Authorization header
            post_json(f"{served.url}/v1/completions", {"prompt": PROMPT, "max_tokens": 2})
        assert no_key.value.code == 401
        assert json.loads(no_key.value.read())["error"]["code"] == "invalid_api_key"
        with pytest.raises(openai.AuthenticationError):
            client("sk-wrong").models.list()
        assert opened == [], "a request without a valid key reached the engine"
        assert get_json(f"{served.url}/health") == {"status": "ok"}  # open to load balancers

        def cached(key: str) -> int:
            return ask(key, LONG_PROMPT).usage.prompt_tokens_details.cached_tokens

        prompt_len = len(engine.tokenize(prompt=LONG_PROMPT))
        assert cached("sk-a") == 0
        assert cached("sk-b") == 0  # the same prompt, another tenant: no hit
        full = (prompt_len - 1) // engine.info.block_size * engine.info.block_size
        assert cached("sk-a") == full and cached("sk-b") == full  # each its own hits
        assert len(opened) == 4

        # n=3: samples 1 and 2 start from the prompt blocks sample 0 cached (all three at once
        # would each compute the whole prompt in one step)
        fresh = "Z " + LONG_PROMPT
        blocks = (len(engine.tokenize(prompt=fresh)) - 1) // engine.info.block_size
        hits = engine.kv_stats().prefix_hit_tokens
        three = client("sk-a").completions.create(model="SmolLM2-135M-Instruct", prompt=fresh,
                                                  temperature=0, max_tokens=2, n=3)
        assert len(three.choices) == 3 and len({c.text for c in three.choices}) == 1  # greedy
        assert engine.kv_stats().prefix_hit_tokens - hits == 2 * blocks * engine.info.block_size
        opened.clear()

        ask("sk-slow")  # the bucket's one request
        with pytest.raises(openai.RateLimitError) as err:
            ask("sk-slow")
        assert err.value.body["param"] == "requests_per_s"
        assert int(err.value.response.headers["retry-after"]) >= 1
        ask("sk-a")  # another tenant is served meanwhile

        ask("sk-thrifty", max_tokens=40)  # crosses 40 tokens: served, the next one waits
        with pytest.raises(openai.RateLimitError) as err:
            ask("sk-thrifty")
        assert err.value.body["param"] == "tokens_per_min"
        ask("sk-b")


def test_a_replica_that_cannot_serve_answers_503_in_openais_shape(make_tiny_engine):
    """After its engine shut down (Serve stopping the replica) or died: /health and the
    generation endpoints answer 503 `service_unavailable_error`, not 500."""
    import asyncio

    from kvserve.cluster.openai.protocol import CompletionRequest, OpenAIError

    core = AsyncLLMEngine(make_tiny_engine())
    serving = OpenAIServing(core, served_model_name="tiny")
    serving.health()  # a fresh engine is healthy

    async def after_shutdown() -> None:
        await core.shutdown()
        with pytest.raises(OpenAIError) as err:
            await serving.completions(CompletionRequest(prompt=[1, 2, 3], max_tokens=2))
        assert err.value.status == 503 and err.value.type == "service_unavailable_error"

    asyncio.run(after_shutdown())
    with pytest.raises(OpenAIError) as err:
        serving.health()
    assert err.value.status == 503 and err.value.body()["error"]["type"] == \
        "service_unavailable_error"


def test_an_http_callers_traceparent_is_the_parent_of_its_request_spans(real_engine):
    from kvserve.cluster.tracing import RequestTracer

    with otlp_receiver() as receiver:
        tracer = RequestTracer(receiver.endpoint)
        try:
            with http_server(real_engine, tracer=tracer) as served:
                reply = served.client.chat.completions.create(
                    model="SmolLM2-135M-Instruct", messages=MESSAGES, max_tokens=3,
                    temperature=0, extra_headers={"traceparent": CALLER_TRACEPARENT})
            assert tracer.flush()
        finally:
            tracer.shutdown()
    [(root, attrs)] = receiver.request_spans().values()
    assert root.trace_id.hex() == CALLER_TRACE_ID and root.parent_span_id.hex() == CALLER_SPAN_ID
    assert attrs["gen_ai.usage.output_tokens"].int_value == reply.usage.completion_tokens == 3
    assert [s.name for s in receiver.children(root)] == ["queued", "prefill", "decode"]


def test_speculative_decoding_over_http_usage_and_opt_out(real_checkpoint):
    """A deployment with prompt-lookup speculation, asked to quote its prompt: the text is
    the same with `speculate: false`, and OpenAI's usage.completion_tokens_details counts the
    drafts the model accepted and rejected (Predicted Outputs' fields)."""
    engine = LLMEngine(EngineConfig(kv_cache_memory=256 * 1024**2, device="cpu",
                                    speculative_method="ngram", num_speculative_tokens=4),
                       checkpoint=real_checkpoint)
    quote = ("The committee met on Tuesday to review the budget for the coming year, and agreed "
             "to fund the new library, the swimming pool and the repairs to the town hall.")
    messages = [{"role": "user", "content": f"Repeat this sentence exactly: {quote}"}]
    with http_server(engine) as served:
        replies = {speculate: served.client.chat.completions.create(
            model="SmolLM2-135M-Instruct", messages=messages, temperature=0, max_tokens=40,
            extra_body={"speculate": speculate}) for speculate in (True, False)}
    on, off = replies[True], replies[False]
    assert on.choices[0].message.content == off.choices[0].message.content
    details = on.usage.completion_tokens_details
    assert details.accepted_prediction_tokens > 0
    assert details.rejected_prediction_tokens >= 0
    assert off.usage.completion_tokens_details.accepted_prediction_tokens == 0
    assert off.usage.completion_tokens_details.rejected_prediction_tokens == 0
