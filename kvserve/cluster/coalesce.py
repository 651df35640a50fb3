"""Merge stream items that arrive within a few milliseconds into one (fewer proxy messages)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from typing import TypeVar

T = TypeVar("T")

_END = object()  # the stream ended


async def coalesce(
    stream: AsyncIterator[T], window_s: float, merge: Callable[[list[T]], T]
) -> AsyncIterator[T]:
    """Re-yield `stream`, merging the items that arrive within `window_s` of the first pending
    one into one (`merge`).

    A background task drains `stream` as it produces, so items that queue up while the consumer
    is busy merge too. An error of `stream` is raised here after the items before it; closing or
    cancelling this generator cancels the drain, which closes `stream` (an engine stream then
    aborts its request).
    """
    queue: asyncio.Queue[tuple[float, object]] = asyncio.Queue()
    pump = asyncio.create_task(_drain(stream, queue))
    try:
        while True:
            batch, end = await _take_window(queue, window_s)
            if batch:
                yield merge(batch)
            if isinstance(end, BaseException):
                raise end
            if end is _END:
                return
    finally:
        pump.cancel()
        await asyncio.wait({pump})


async def _drain(stream: AsyncIterator[object], queue: asyncio.Queue) -> None:
    """Queue (arrival monotonic seconds, item) per item, then _END or the stream's error."""
    try:
        async for item in stream:
            queue.put_nowait((time.monotonic(), item))
    except Exception as exc:  # noqa: BLE001 - handed to the consumer, raised there
        queue.put_nowait((time.monotonic(), exc))
    else:
        queue.put_nowait((time.monotonic(), _END))


async def _take_window(queue: asyncio.Queue, window_s: float) -> tuple[list, object | None]:
    """The items that arrived within `window_s` of the next one; and _END or an exception when
    the stream ended inside the window (None otherwise)."""
    arrived_s, item = await queue.get()
    deadline_s, batch = arrived_s + window_s, []
    while item is not _END and not isinstance(item, BaseException):
        batch.append(item)
        if queue.empty():
            wait_s = deadline_s - time.monotonic()
            if wait_s <= 0:
                return batch, None
            try:
                _, item = await asyncio.wait_for(queue.get(), wait_s)
            except TimeoutError:
                return batch, None
        else:
            _, item = queue.get_nowait()
    return batch, item
