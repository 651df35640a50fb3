"""The free blocks of a KV pool (device or host tier): a stack, the block freed last on top.

Why a stack and not a FIFO queue: a CPU pool's pages cost memory only once written
(`kv_cache._zero_pages`), so taking the block freed last keeps a run inside the part of the pool
it already wrote, which is also the part still warm in the CPU's caches; a queue would walk
every block of the pool in turn. Block 0 is on top at the start, so the blocks ever taken are
always ids 0..num_touched-1 and `num_touched` is exactly how much of the pool a run has written.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator


class FreeBlocks:
    def __init__(self, num_blocks: int) -> None:
        self._stack = list(range(num_blocks - 1, -1, -1))
        self.num_touched = 0  # blocks ever taken: ids 0..num_touched-1

    def take(self) -> int:
        block_id = self._stack.pop()
        self.num_touched = max(self.num_touched, block_id + 1)
        return block_id

    def put(self, block_ids: Iterable[int]) -> None:
        """Free `block_ids`; the last one is taken first."""
        self._stack.extend(block_ids)

    def __len__(self) -> int:
        return len(self._stack)

    def __iter__(self) -> Iterator[int]:
        return iter(self._stack)
