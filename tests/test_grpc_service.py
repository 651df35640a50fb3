"""The gRPC contract over real gRPC (a grpc.aio server on loopback) and the real model."""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import pytest

from kvserve.cluster.service import GenerationService, add_to_server
from kvserve.protogen import ROOT, generate
from kvserve.v1 import generation_pb2 as pb
from kvserve.v1 import generation_pb2_grpc as pb_grpc
from kvserve.workers.async_engine import AsyncLLMEngine
from tests.helpers import assert_engine_idle, solo_ids
from tests.otlp import CALLER_SPAN_ID, CALLER_TRACE_ID, CALLER_TRACEPARENT, otlp_receiver


def test_committed_stubs_equal_a_fresh_generation(tmp_path: Path):
    for fresh in generate(tmp_path):
        committed = ROOT / fresh.relative_to(tmp_path)
        assert committed.read_bytes() == fresh.read_bytes(), f"run `make proto`: {committed}"


def serve(engine, scenario, **service_kwargs):
    """Run `scenario(stub, core)` against a loopback server over `engine`."""

    async def main():
        core = AsyncLLMEngine(engine)
        server = grpc.aio.server()
        add_to_server(GenerationService(core, **service_kwargs), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                await scenario(pb_grpc.GenerationStub(channel), core)
        finally:
            await server.stop(grace=None)
            await core.shutdown()

    asyncio.run(main())


def test_generate_streams_the_engines_tokens(real_engine):
    prompt = "The history of the Roman Empire"
    expected = solo_ids(real_engine, prompt=prompt, params={"temperature": 0, "max_tokens": 20})

    async def scenario(stub, core):
        request = pb.GenerateRequest(
            prompt=prompt, params=pb.SamplingParams(temperature=0, max_tokens=20, logprobs=2)
        )
        responses = [r async for r in stub.Generate(request)]
        assert [t for r in responses for t in r.token_ids] == expected
        assert len(responses) == 20  # streamed token by token
        last = responses[-1]
        assert last.finish_reason == pb.FINISH_REASON_LENGTH
        assert last.usage.completion_tokens == 20 and last.usage.time_to_first_token_ms > 0
        assert all(len(r.logprobs) == 1 and len(r.logprobs[0].top) == 2 for r in responses)

    serve(real_engine, scenario)
    assert_engine_idle(real_engine)


@pytest.mark.parametrize(
    ("request_kwargs", "field"),
    [
        ({"prompt": ""}, "prompt"),
        ({}, "prompt"),
        ({"prompt": "hi", "params": pb.SamplingParams(top_p=1.5)}, "top_p"),
        ({"prompt": "hi", "params": pb.SamplingParams(seed=-1)}, "seed"),
        ({"prompt_token_ids": pb.TokenIds(ids=[5, 49152])}, "prompt_token_ids"),
        ({"messages": pb.ChatMessages()}, "messages"),
    ],
)
def test_bad_input_is_invalid_argument_naming_the_field(real_engine, request_kwargs, field):
    async def scenario(stub, core):
        with pytest.raises(grpc.aio.AioRpcError) as err:
            async for _ in stub.Generate(pb.GenerateRequest(**request_kwargs)):
                pass
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert field in err.value.details()

    serve(real_engine, scenario)
    assert_engine_idle(real_engine)


def test_cancelling_the_stream_frees_the_requests_blocks(real_engine):
    async def scenario(stub, core):
        call = stub.Generate(
            pb.GenerateRequest(
                prompt="Count to one thousand:",
                params=pb.SamplingParams(max_tokens=500, ignore_eos=True),
            )
        )
        async for _ in call:
            break  # one token arrived: the request is running
        assert real_engine.requests
        call.cancel()
        for _ in range(100):
            if not real_engine.requests:
                break
            await asyncio.sleep(0.01)
        assert_engine_idle(real_engine)

    serve(real_engine, scenario)


def test_model_info_and_tokenize(real_engine):
    async def scenario(stub, core):
        info = await stub.ModelInfo(pb.ModelInfoRequest())
        assert (info.model, info.vocab_size, info.max_model_len) == (
            "SmolLM2-135M-Instruct",
            49152,
            8192,
        )
        assert info.rope_parameters["rope_theta"] == 100000.0
        tokens = await stub.Tokenize(pb.TokenizeRequest(prompt="Hello, world"))
        assert list(tokens.token_ids) == real_engine.tokenizer("Hello, world")["input_ids"]
        assert tokens.count == len(tokens.token_ids)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.Tokenize(pb.TokenizeRequest(prompt=""))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT

    serve(real_engine, scenario)



def test_a_request_gets_its_timeline_when_it_asks_for_it(real_engine):
    """`return_timeline`: the last response carries the engine's own timeline of the request
    (the same events as in-process); without it, no timeline travels."""

    async def scenario(stub, core):
        params = pb.SamplingParams(temperature=0, max_tokens=4)
        asked = [r async for r in stub.Generate(pb.GenerateRequest(
            prompt="Hello there", params=params, return_timeline=True))]
        plain = [r async for r in stub.Generate(pb.GenerateRequest(prompt="Hello there",
                                                                   params=params))]
        assert not any(r.HasField("timeline") for r in plain)
        assert not any(r.HasField("timeline") for r in asked[:-1])
        events = asked[-1].timeline.events
        assert [e.kind for e in events] == ["arrived", "admitted", "prefill", "first_token",
                                            "decode", "decode", "decode", "finished"]
        assert events[-1].detail == "length"
        n = asked[-1].usage.prompt_tokens
        assert [e.first for e in events if e.kind == "decode"] == [n, n + 1, n + 2]
        prefill = events[2]
        assert (prefill.first, prefill.num_tokens, prefill.batch_size) == (0, n, 1)
        assert prefill.HasField("duration_s") and prefill.duration_s > 0
        times = [e.time for e in events]
        assert times == sorted(times)
        assert events[3].time - events[0].time == pytest.approx(
            asked[-1].usage.time_to_first_token_ms / 1000, abs=1e-3)

    serve(real_engine, scenario)


def test_request_spans_reach_an_otlp_receiver_under_the_callers_trace(real_engine):
    from kvserve.cluster.tracing import RequestTracer

    async def scenario(stub, core):
        params = pb.SamplingParams(temperature=0, max_tokens=3)
        done = [r async for r in stub.Generate(
            pb.GenerateRequest(prompt="Hello", params=params, request_id="traced"),
            metadata=[("traceparent", CALLER_TRACEPARENT)])]
        assert done[-1].finish_reason == pb.FINISH_REASON_LENGTH
        [r async for r in stub.Generate(
            pb.GenerateRequest(prompt="Hi", params=params, request_id="untraced"))]

    with otlp_receiver() as receiver:
        tracer = RequestTracer(receiver.endpoint)
        try:
            serve(real_engine, scenario, tracer=tracer)
            assert tracer.flush()
        finally:
            tracer.shutdown()
    spans = receiver.request_spans()
    root, attrs = spans["traced"]
    assert root.trace_id.hex() == CALLER_TRACE_ID and root.parent_span_id.hex() == CALLER_SPAN_ID
    assert attrs["gen_ai.usage.output_tokens"].int_value == 3
    children = receiver.children(root)
    assert [s.name for s in children] == ["queued", "prefill", "decode"]
    assert all(s.trace_id == root.trace_id for s in children)
    assert root.start_time_unix_nano <= children[0].start_time_unix_nano
    assert children[-1].end_time_unix_nano <= root.end_time_unix_nano
    decode = {a.key: a.value for a in children[2].attributes}
    assert decode["kvserve.steps"].int_value == 2  # tokens 2 and 3; the first came from prefill
    assert "first_token" in [e.name for e in root.events]
    # without a caller's context, a trace of its own
    lone, _ = spans["untraced"]
    assert lone.trace_id.hex() != CALLER_TRACE_ID and not lone.parent_span_id


def test_speculation_is_reported_in_usage_and_a_request_can_opt_out(make_tiny_engine):
    """A deployment that speculates (the target as its own draft: every greedy draft is
    accepted): its responses carry several tokens each and usage counts the drafts; a request
    with `speculate: false` gets the same tokens one per response and no drafts."""
    engine = make_tiny_engine(speculative_method="draft_model", num_speculative_tokens=3)
    params = {"temperature": 0, "max_tokens": 16, "ignore_eos": True}

    async def scenario(stub, core):
        results = {}
        for speculate in (True, False):
            request = pb.GenerateRequest(prompt="one two three",
                                         params=pb.SamplingParams(**params, speculate=speculate))
            results[speculate] = [r async for r in stub.Generate(request)]
        on, off = results[True], results[False]
        ids = [[t for r in rs for t in r.token_ids] for rs in (on, off)]
        assert ids[0] == ids[1] and len(ids[0]) == 16
        assert len(off) == 16 and len(on) < 16
        assert off[-1].usage.draft_tokens == off[-1].usage.accepted_draft_tokens == 0
        usage = on[-1].usage
        assert usage.accepted_draft_tokens == usage.draft_tokens > 0
        assert usage.accepted_draft_tokens == 16 - len(on)  # each response: 1 + accepted

    serve(engine, scenario)
    assert_engine_idle(engine)
