"""Token coalescing for streams (`stream_coalesce_ms`): the merge and the time window, no model."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from kvserve.cluster.coalesce import coalesce
from kvserve.cluster.service import merge_responses
from kvserve.v1 import generation_pb2 as pb


def msg(ids: list[int], text: str, **fields) -> pb.GenerateResponse:
    logprobs = [pb.TokenLogprob(token_id=t, logprob=-0.5) for t in ids]
    return pb.GenerateResponse(request_id="r", token_ids=ids, text=text, logprobs=logprobs,
                               **fields)


def test_merge_concatenates_tokens_text_logprobs_and_keeps_the_last_finish_and_usage():
    usage = pb.Usage(prompt_tokens=5, completion_tokens=4, time_to_first_token_ms=12.5)
    parts = [msg([1], "Hel"), msg([2, 3], "lo"),
             msg([4], "!", finish_reason=pb.FINISH_REASON_LENGTH, usage=usage)]
    merged = merge_responses(parts)
    assert merged.request_id == "r"
    assert list(merged.token_ids) == [1, 2, 3, 4]
    assert merged.text == "Hello!"
    assert [lp.token_id for lp in merged.logprobs] == [1, 2, 3, 4]
    assert merged.finish_reason == pb.FINISH_REASON_LENGTH
    assert merged.usage == usage


def test_merge_of_unfinished_messages_has_no_finish_reason_or_usage():
    merged = merge_responses([msg([1], "a"), msg([2], "b")])
    assert merged.finish_reason == pb.FINISH_REASON_UNSPECIFIED
    assert not merged.HasField("usage")


def test_merge_of_one_message_is_that_message():
    one = msg([7], "x")
    assert merge_responses([one]) is one


async def timed(items: list[tuple[float, object]]) -> AsyncIterator[object]:
    """Yield each item after its delay in seconds; an exception item is raised."""
    for delay_s, item in items:
        await asyncio.sleep(delay_s)
        if isinstance(item, BaseException):
            raise item
        yield item


def collect(items: list[tuple[float, object]], window_s: float) -> list[list[object]]:
    async def run() -> list[list[object]]:
        return [batch async for batch in coalesce(timed(items), window_s, list)]

    return asyncio.run(run())


def test_items_within_the_window_of_the_first_pending_one_merge():
    # 1, 2, 3 come within 5 ms; 4 arrives 0.6 s later, far outside the (generous) 0.2 s window
    items = [(0, 1), (0, 2), (0.005, 3), (0.6, 4)]
    assert collect(items, 0.2) == [[1, 2, 3], [4]]


def test_items_further_apart_than_the_window_stay_separate():
    assert collect([(0, 1), (0.1, 2), (0.1, 3)], 0.02) == [[1], [2], [3]]


def test_an_error_arrives_after_the_items_before_it():
    async def run() -> list[list[object]]:
        seen = []
        with pytest.raises(ValueError, match="boom"):
            async for batch in coalesce(timed([(0, 1), (0, 2), (0, ValueError("boom"))]), 0.05,
                                        list):
                seen.append(batch)
        return seen

    assert asyncio.run(run()) == [[1, 2]]


def test_closing_early_closes_the_source_stream():
    closed = asyncio.Event()

    async def endless() -> AsyncIterator[int]:
        try:
            n = 0
            while True:
                n += 1
                yield n
                await asyncio.sleep(0.01)
        finally:
            closed.set()

    async def run() -> None:
        stream = coalesce(endless(), 0.001, list)
        assert await anext(stream) == [1]
        await stream.aclose()
        await asyncio.wait_for(closed.wait(), 1)

    asyncio.run(run())
