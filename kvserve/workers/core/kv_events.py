"""What the block manager hands to others: KV copies to run before a step, and cache events.

`KVCopyPlan` is the step's batch of copies between the device pool and the host tier: all
device->host copies run before all host->device ones, and both before the model writes, so a
device block freed by a swap-out can be refilled in the same step. `KVEvents` buffers "block
stored / removed" events for the cluster's cache manager; it is off (records nothing) in a
stand-alone engine.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Literal

Tier = Literal["device", "host"]


@dataclass
class KVCopyPlan:
    to_host: list[tuple[int, int]] = field(default_factory=list)  # (device block, host block)
    to_device: list[tuple[int, int]] = field(default_factory=list)  # (host block, device block)
    release_host: list[int] = field(default_factory=list)  # host blocks free once copied

    def __bool__(self) -> bool:
        return bool(self.to_host or self.to_device or self.release_host)


@dataclass(frozen=True)
class KVEvent:
    kind: Literal["stored", "removed"]
    tier: Tier
    block_hash: bytes


class KVEvents:
    """A thread-safe buffer (deque append/popleft) between the engine's step and a reporter."""

    def __init__(self, enabled: bool = False) -> None:
        self.enabled = enabled
        self._buffer: deque[KVEvent] = deque()

    def record(self, kind: Literal["stored", "removed"], tier: Tier, block_hash: bytes) -> None:
        if self.enabled:
            self._buffer.append(KVEvent(kind, tier, block_hash))

    def drain(self) -> list[KVEvent]:
        out = []
        while self._buffer:
            out.append(self._buffer.popleft())
        return out
