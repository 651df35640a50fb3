"""Every bad input gets InvalidRequestError naming its field, while a concurrent
valid request finishes normally and nothing leaks."""

from __future__ import annotations

import asyncio

import pytest

from kvserve.workers.async_engine import AsyncLLMEngine
from kvserve.workers.errors import InvalidRequestError
from tests.helpers import assert_engine_idle

GOOD = {"max_tokens": 8}

BAD_INPUTS: list[tuple[str, dict]] = [
    ("prompt", {"prompt": "", "params": GOOD}),
    ("prompt", {"prompt_token_ids": [11] * 8192, "params": GOOD}),
    ("prompt", {"prompt": "a", "prompt_token_ids": [1, 2], "params": GOOD}),
    ("prompt", {"params": GOOD}),
    ("prompt_token_ids", {"prompt_token_ids": [], "params": GOOD}),
    ("prompt_token_ids", {"prompt_token_ids": [5, 2.5], "params": GOOD}),
    ("prompt_token_ids", {"prompt_token_ids": [5, "7"], "params": GOOD}),
    ("prompt_token_ids", {"prompt_token_ids": [5, 49152], "params": GOOD}),
    ("prompt_token_ids", {"prompt_token_ids": [-1], "params": GOOD}),
    ("messages[0]", {"messages": [{"role": "user"}], "params": GOOD}),
    ("messages", {"messages": [], "params": GOOD}),
    ("max_tokens", {"prompt": "hi", "params": {"max_tokens": 0}}),
    ("max_tokens", {"prompt": "hi", "params": {"max_tokens": -3}}),
    ("max_tokens", {"prompt": "hi", "params": {"max_tokens": 8192}}),
    ("max_tokens", {"prompt": "hi", "params": {"max_tokens": "5"}}),
    ("temperature", {"prompt": "hi", "params": {"temperature": -0.1}}),
    ("temperature", {"prompt": "hi", "params": {"temperature": float("nan")}}),
    ("top_p", {"prompt": "hi", "params": {"top_p": 0.0}}),
    ("top_p", {"prompt": "hi", "params": {"top_p": 1.01}}),
    ("top_k", {"prompt": "hi", "params": {"top_k": -2}}),
    ("min_p", {"prompt": "hi", "params": {"min_p": 1.5}}),
    ("min_p", {"prompt": "hi", "params": {"min_p": -0.1}}),
    ("repetition_penalty", {"prompt": "hi", "params": {"repetition_penalty": 0.0}}),
    ("presence_penalty", {"prompt": "hi", "params": {"presence_penalty": 2.5}}),
    ("frequency_penalty", {"prompt": "hi", "params": {"frequency_penalty": -2.5}}),
    ("seed", {"prompt": "hi", "params": {"seed": -1}}),
    ("logprobs", {"prompt": "hi", "params": {"logprobs": 100}}),
    ("stop", {"prompt": "hi", "params": {"stop": [""]}}),
    ("stop_token_ids", {"prompt": "hi", "params": {"stop_token_ids": [10**6]}}),
    ("ignore_eos", {"prompt": "hi", "params": {"ignore_eos": "yes"}}),
    ("bogus_field", {"prompt": "hi", "params": {"max_tokens": 4, "bogus_field": 1}}),
    ("params", {"prompt": "hi", "params": 7}),
]


async def _drain(engine: AsyncLLMEngine, request: dict) -> list:
    return [out async for out in engine.generate(**request)]


def test_bad_inputs_are_rejected_by_field_while_a_good_request_runs(real_engine):
    async def scenario() -> None:
        engine = AsyncLLMEngine(real_engine)
        good = asyncio.create_task(_drain(engine, {
            "prompt": "Count from one to twenty:", "params": {"max_tokens": 24, "temperature": 0},
            "request_id": "good",
        }))
        await asyncio.sleep(0.05)  # the good request is admitted and decoding
        for field, request in BAD_INPUTS:
            with pytest.raises(InvalidRequestError) as err:
                await _drain(engine, request)
            assert err.value.field == field, (field, request, str(err.value))
            assert field.split("[")[0] in str(err.value)
        with pytest.raises(InvalidRequestError) as err:  # the good one's id is taken
            await _drain(engine, {"prompt": "hi", "params": GOOD, "request_id": "good"})
        assert err.value.field == "request_id"
        outputs = await good
        assert outputs[-1].finish_reason == "length"
        assert outputs[-1].usage.completion_tokens == 24
        await engine.shutdown()

    asyncio.run(scenario())
    assert_engine_idle(real_engine)
