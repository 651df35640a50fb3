"""Assertions shared by tests."""

from __future__ import annotations

import collections
import time
from collections.abc import Callable
from typing import Any, TypeVar

import torch
from torch.overrides import TorchFunctionMode

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


SYNCS = {"tolist", "cpu", "item", "__int__", "__float__", "__bool__", "__index__", "numpy"}
CREATIONS = {"tensor", "as_tensor", "from_numpy"}


def _has_list(index: Any) -> bool:
    items = index if isinstance(index, tuple) else (index,)
    return any(isinstance(i, list) for i in items)


class HostTraffic(TorchFunctionMode):
    """Counts, inside its block, what would cost a device->host sync (reading a tensor's values
    on the host), and host->device creations (a tensor built from host data: torch.tensor,
    torch.as_tensor, from_numpy, or indexing with a Python list) and transfers (`.to(device)`)."""

    def __init__(self) -> None:
        super().__init__()
        self.syncs = 0
        self.creations = 0
        self.transfers = 0
        self.calls: collections.Counter[str] = collections.Counter()

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        name = getattr(func, "__name__", str(func))
        self.calls[name] += 1
        if name in SYNCS:
            self.syncs += 1
        elif name in CREATIONS or (
            name in ("__getitem__", "__setitem__") and _has_list(args[1])
        ):
            self.creations += 1
        elif name in ("to", "cuda") and (
            "device" in kwargs or any(isinstance(a, (str, torch.device)) for a in args[1:])
        ):
            self.transfers += 1
        return func(*args, **kwargs)
