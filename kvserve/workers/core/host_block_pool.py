"""The host tier of the KV cache (CPU offload): block bookkeeping only, no tensors.

It holds two kinds of blocks: cached ones, demoted from the device when the device pool needed
their space (kept in an LRU by hash, restored by copy on a later prefix hit), and swapped ones,
the KV of preempted sequences, owned by them until they resume. Swapped blocks are never
evicted; cached ones are, least recently used first, when a new block is needed. A cached
block that is the source of a copy this step is pinned until the copy has run.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from kvserve.workers.core.free_blocks import FreeBlocks
from kvserve.workers.core.kv_events import KVEvents


class HostBlockPool:
    def __init__(self, num_blocks: int, events: KVEvents) -> None:
        if num_blocks <= 0:
            raise ValueError("the host tier needs at least one block")
        self.num_blocks = num_blocks
        self.events = events
        self.free_ids = FreeBlocks(num_blocks)  # the block freed last is taken first
        self.cached: OrderedDict[bytes, int] = OrderedDict()  # hash -> host block, LRU first
        self.token_ids: dict[int, tuple[int, ...]] = {}  # cached host block -> its tokens
        self.pinned: set[int] = set()  # cached blocks a pending copy reads
        self.num_evicted = 0

    @property
    def num_free(self) -> int:
        """Blocks a swap-out or a demotion can take: free ones and unpinned cached ones."""
        return len(self.free_ids) + sum(1 for b in self.cached.values() if b not in self.pinned)

    @property
    def num_used(self) -> int:
        """Blocks holding KV: cached and swapped ones."""
        return self.num_blocks - len(self.free_ids)

    @property
    def num_touched(self) -> int:
        """Blocks ever taken (`FreeBlocks`): the host pool's pages in RAM on a CPU."""
        return self.free_ids.num_touched

    def usage(self) -> float:
        return 1.0 - len(self.free_ids) / self.num_blocks

    def take(self) -> int | None:
        """A block for new contents (evicting the least recently used cached one), or None."""
        if self.free_ids:
            return self.free_ids.take()
        for block_hash, block_id in self.cached.items():
            if block_id not in self.pinned:
                del self.cached[block_hash]
                del self.token_ids[block_id]
                self.num_evicted += 1
                self.events.record("removed", "host", block_hash)
                return block_id
        return None

    def demote(self, block_hash: bytes, token_ids: Sequence[int]) -> int | None:
        """A block to copy an evicted device block into; None if it is already here (or no room)."""
        if block_hash in self.cached:
            self.cached.move_to_end(block_hash)
            return None
        block_id = self.take()
        if block_id is not None:
            self.cached[block_hash] = block_id
            self.token_ids[block_id] = tuple(token_ids)
            self.events.record("stored", "host", block_hash)
        return block_id

    def lookup(self, block_hash: bytes, token_ids: Sequence[int]) -> int | None:
        """The cached block for `block_hash` with exactly these tokens, pinned for a copy."""
        block_id = self.cached.get(block_hash)
        if block_id is None or self.token_ids[block_id] != tuple(token_ids):
            return None
        self.cached.move_to_end(block_hash)
        self.pinned.add(block_id)
        return block_id

    def release(self, block_ids: Sequence[int]) -> None:
        """Swapped blocks whose contents went back to the device: free again."""
        self.free_ids.put(block_ids)

    def unpin_all(self) -> None:
        self.pinned.clear()

    def hashes(self) -> list[bytes]:
        return list(self.cached)
