"""Assertions shared by tests."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

from workers.engine import LLMEngine

T = TypeVar("T")


def assert_engine_idle(engine: LLMEngine) -> None:
    """Nothing running and every KV block back in the free pool."""
    assert not engine.has_unfinished()
    assert not engine.requests
    assert engine.block_manager.num_free == engine.block_manager.num_blocks
    host = engine.block_manager.host
    if host is not None:  # no swapped-out KV left behind: every host block free or cached
        assert len(host.free_ids) + len(host.cached) == host.num_blocks
        assert not host.pinned


def output_ids(outputs) -> list[int]:
    """All token ids of one request's stream of RequestOutputs."""
    return [t for o in outputs for t in o.token_ids]


def solo_ids(engine: LLMEngine, **request) -> list[int]:
    """The token ids of one request run alone to completion on `engine`."""
    return output_ids(next(iter(engine.generate_all([request]).values())))


def poll(read: Callable[[], T], until: Callable[[T], bool], timeout_s: float,
         interval_s: float = 0.2) -> T:
    """`read()` every `interval_s` until `until(value)` or `timeout_s` has passed; the last
    value, so the caller asserts on what it saw (a timeout is not an error by itself)."""
    deadline = time.monotonic() + timeout_s
    value = read()
    while not until(value) and time.monotonic() < deadline:
        time.sleep(interval_s)
        value = read()
    return value
