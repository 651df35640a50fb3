"""The Ray Serve application over real Ray (local) and Ray Serve's own gRPC proxy."""

from __future__ import annotations

import socket
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from pydantic import ValidationError

from cluster.app import GRPC_SERVICER_FUNCTIONS, AppConfig, build_app
from kvserve.v1 import generation_pb2 as pb
from kvserve.v1 import generation_pb2_grpc as pb_grpc
from tests.helpers import output_ids

APP = "kvserve"
METADATA = (("application", APP),)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def served():
    """One replica on a local Ray cluster; yields (stub, deployment handle)."""
    import ray
    from ray import serve
    from ray.serve.config import gRPCOptions

    metrics_port = _free_port()
    ray.init(
        num_cpus=2,
        include_dashboard=False,
        log_to_driver=False,
        _metrics_export_port=metrics_port,
        _system_config={"metrics_report_interval_ms": 1000},
    )
    port = _free_port()
    serve.start(
        grpc_options=gRPCOptions(port=port, grpc_servicer_functions=GRPC_SERVICER_FUNCTIONS),
        http_options={"host": "127.0.0.1", "port": _free_port()},
    )
    # two sequences at a time, so that a third request waits (the waiting gauge is exercised)
    handle = serve.run(build_app({"kv_cache_memory": "256MiB", "max_num_seqs": 2}), name=APP)
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    try:
        yield pb_grpc.GenerationStub(channel), handle, f"127.0.0.1:{port}", metrics_port
    finally:
        channel.close()
        serve.shutdown()
        ray.shutdown()


def _stream(stub, prompt: str, **params) -> list[pb.GenerateResponse]:
    request = pb.GenerateRequest(prompt=prompt, params=pb.SamplingParams(**params))
    return list(stub.Generate(request, metadata=METADATA))


def test_concurrent_streams_equal_the_in_process_engine(served, real_engine):
    stub, *_ = served
    prompts = ["The capital of France is", "def add(a, b):", "Once upon a time", "1, 2, 3,"]
    expected = [
        output_ids(
            next(
                iter(
                    real_engine.generate_all(
                        [{"prompt": p, "params": {"temperature": 0, "max_tokens": 16}}]
                    ).values()
                )
            )
        )
        for p in prompts
    ]
    with ThreadPoolExecutor(len(prompts)) as pool:
        results = list(pool.map(lambda p: _stream(stub, p, temperature=0, max_tokens=16), prompts))
    for responses, want in zip(results, expected, strict=True):
        assert [t for r in responses for t in r.token_ids] == want
        assert responses[-1].finish_reason == pb.FINISH_REASON_LENGTH


def test_bad_input_is_invalid_argument_through_the_proxy(served):
    stub, *_ = served
    with pytest.raises(grpc.RpcError) as err:
        _stream(stub, "hi", top_p=1.5)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "top_p" in err.value.details()
    assert _stream(stub, "hi", max_tokens=2)[-1].finish_reason == pb.FINISH_REASON_LENGTH


def test_cancelled_stream_frees_its_blocks_on_the_replica(served):
    stub, handle, *_ = served
    call = stub.Generate(
        pb.GenerateRequest(
            prompt="Count to a thousand:",
            params=pb.SamplingParams(max_tokens=1000, ignore_eos=True),
        ),
        metadata=METADATA,
    )
    next(call)
    assert handle.kv_cache_usage.remote().result() > 0
    call.cancel()
    deadline = time.monotonic() + 5
    while handle.kv_cache_usage.remote().result() > 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert handle.kv_cache_usage.remote().result() == 0


def test_model_info_through_the_proxy(served):
    stub, *_ = served
    info = stub.ModelInfo(pb.ModelInfoRequest(), metadata=METADATA)
    assert (info.model, info.replicas, info.vocab_size) == ("SmolLM2-135M-Instruct", 1, 49152)


def test_app_config_rejects_unknown_and_bad_fields():
    with pytest.raises(ValidationError, match="replicaz"):
        AppConfig.model_validate({"replicaz": 2})
    with pytest.raises(ValidationError, match="replicas"):
        AppConfig.model_validate({"replicas": 0})


def test_async_client_streams_and_reports_errors(served):
    import asyncio

    from cluster.client import AsyncClient

    _, _, target, _ = served

    async def scenario() -> None:
        async with AsyncClient(target) as client:
            chunks = [c async for c in client.generate("Hello", max_tokens=5, temperature=0)]
            assert sum(len(c.token_ids) for c in chunks) == 5
            assert (await client.model_info()).replicas == 1
            with pytest.raises(grpc.aio.AioRpcError) as err:
                async for _ in client.generate(prompt_token_ids=[1, 10**9]):
                    pass
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "prompt_token_ids" in err.value.details()

    asyncio.run(scenario())


def _metric_values(text: str) -> dict[str, float]:
    """Prometheus text -> the largest sample per metric family name."""
    values: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("#") or not line.strip():
            continue
        name = line.split("{")[0].split(" ")[0]
        values[name] = max(values.get(name, 0.0), float(line.rsplit(" ", 1)[-1]))
    return values


def _nonzero(values: dict[str, float], metric: str) -> bool:
    """The exact Prometheus names the Grafana dashboard queries (histograms via _count)."""
    return values.get(f"ray_{metric}", 0) > 0 or values.get(f"ray_{metric}_count", 0) > 0


def test_prometheus_endpoint_exposes_every_metric_during_traffic(served):
    import urllib.request

    from cluster.metrics import METRIC_NAMES

    stub, _, _, metrics_port = served
    assert _stream(stub, "Hi", max_tokens=3)[-1].finish_reason  # a finished request
    long = pb.GenerateRequest(
        prompt="Tell me a long story.", params=pb.SamplingParams(max_tokens=2000, ignore_eos=True)
    )
    calls = [stub.Generate(long, metadata=METADATA) for _ in range(3)]  # the third one waits
    missing: list[str] = list(METRIC_NAMES)
    deadline = time.monotonic() + 60
    try:
        while missing and time.monotonic() < deadline:
            for _ in range(5):
                next(calls[0]), next(calls[1])  # keep tokens (and so the gauges) moving
            url = f"http://127.0.0.1:{metrics_port}/metrics"
            text = urllib.request.urlopen(url, timeout=5).read().decode()
            values = _metric_values(text)
            missing = [m for m in METRIC_NAMES if not _nonzero(values, m)]
    finally:
        for call in calls:
            call.cancel()
    assert not missing, f"metrics absent or zero: {missing}"
