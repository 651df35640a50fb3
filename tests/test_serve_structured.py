"""Structured outputs through Ray Serve: the 30 acceptance prompts on five schemas over HTTP
with the official `openai` SDK and over gRPC, side by side; errors by protocol. The engine's
side (masks, exactness, batch invariance): tests/test_structured_outputs.py."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import grpc
import openai
import pytest

from kvserve.bench.structured import SCHEMAS, cases
from kvserve.cluster.client import Client
from tests.helpers import schema_errors
from tests.serving import APP, DEFAULT_APP, serve_locally

USES_SHARED_RAY = "1"  # tests/serving.py: run with the modules of this group

pytestmark = pytest.mark.ray  # starts Ray, so also slow (tests/suite_plugin.py)

MAX_TOKENS = 160  # as tests/test_structured_outputs.py
MODEL = "SmolLM2-135M-Instruct"


def _http(client: openai.OpenAI, name: str, prompt: str) -> str:
    reply = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": prompt}], temperature=0,
        max_tokens=MAX_TOKENS,
        response_format={"type": "json_schema",
                         "json_schema": {"name": name, "schema": SCHEMAS[name]}})
    return reply.choices[0].message.content


def _grpc(target: str, name: str, prompt: str) -> str:
    with Client(target, application=APP) as client:
        return "".join(r.text for r in client.generate(
            messages=[{"role": "user", "content": prompt}], temperature=0,
            max_tokens=MAX_TOKENS, structured_outputs={"json": SCHEMAS[name]}))


def test_structured_outputs_validate_over_http_and_grpc():
    """Every answer of the 30 (5 schemas x 6 prompts), over each protocol, parses and
    validates with `jsonschema`; greedy, so both protocols give the same text. The negative
    control (the same prompts unconstrained fail) runs in-process in
    tests/test_structured_outputs.py."""
    with serve_locally(DEFAULT_APP, reuse=True, name=APP) as served:
        client = openai.OpenAI(base_url=f"{served.http_url}/v1", api_key="unused",
                               max_retries=0, timeout=300)
        with ThreadPoolExecutor(2 * len(cases())) as pool:  # one batch on the replica
            http = pool.map(lambda c: _http(client, *c), cases())
            rpc = pool.map(lambda c: _grpc(served.target, *c), cases())
            answers = {"http": list(http), "grpc": list(rpc)}
    for protocol, texts in answers.items():
        assert schema_errors(dict(zip(cases(), texts, strict=True))) == [], protocol
    assert answers["http"] == answers["grpc"]


def test_a_schema_that_does_not_compile_is_a_400_or_invalid_argument_naming_the_field():
    with serve_locally(DEFAULT_APP, reuse=True, name=APP) as served:
        client = openai.OpenAI(base_url=f"{served.http_url}/v1", api_key="unused",
                               max_retries=0)
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "hi"}],
                response_format={"type": "json_schema", "json_schema": {
                    "name": "bad", "schema": {"type": "no-such-type"}}})
        assert err.value.body["param"] == "response_format"
        with pytest.raises(openai.BadRequestError) as err:
            client.completions.create(model=MODEL, prompt="hi",
                                      extra_body={"guided_regex": "(unclosed"})
        assert err.value.body["param"] == "guided_regex"
        with Client(served.target, application=APP) as rpc, \
                pytest.raises(grpc.RpcError) as rpc_err:
            list(rpc.generate("hi", structured_outputs={"regex": "(unclosed"}))
        assert rpc_err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "structured_outputs" in rpc_err.value.details()
        # nothing else was disturbed: the next request is served
        assert client.completions.create(model=MODEL, prompt="hi", max_tokens=2).choices
