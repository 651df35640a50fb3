"""KV block allocation: pure bookkeeping, no tensors.

Every block of the pool is either free or owned by exactly one live sequence. Blocks carry a
reference count and an optional content hash so that read-only sharing (prefix caching) can be
added without changing this interface; today a block's count is 0 (free) or 1 (owned).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    block_hash: bytes | None = None  # set once the block is full, for prefix caching


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError("num_blocks and block_size must be positive")
        self.block_size = block_size
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_ids: deque[int] = deque(range(num_blocks))

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free(self) -> int:
        return len(self.free_ids)

    def usage(self) -> float:
        return 1.0 - self.num_free / self.num_blocks

    def blocks_needed(self, block_table: list[int], num_tokens: int) -> int:
        """Blocks to add so that `block_table` holds `num_tokens` tokens."""
        return max(0, -(-num_tokens // self.block_size) - len(block_table))

    def can_allocate(self, block_table: list[int], num_tokens: int) -> bool:
        return self.blocks_needed(block_table, num_tokens) <= self.num_free

    def allocate(self, block_table: list[int], num_tokens: int) -> None:
        """Grow `block_table` in place to hold `num_tokens` tokens."""
        needed = self.blocks_needed(block_table, num_tokens)
        if needed > self.num_free:
            raise MemoryError(f"need {needed} KV blocks, {self.num_free} free")
        for _ in range(needed):
            block = self.blocks[self.free_ids.popleft()]
            assert block.ref_count == 0, f"block {block.block_id} is free but referenced"
            block.ref_count = 1
            block_table.append(block.block_id)

    def deallocate(self, block_table: list[int]) -> None:
        """Release every block of `block_table` and empty it."""
        for block_id in reversed(block_table):
            block = self.blocks[block_id]
            assert block.ref_count > 0, f"double free of block {block_id}"
            block.ref_count -= 1
            if block.ref_count == 0:
                block.block_hash = None
                self.free_ids.append(block_id)
        block_table.clear()
