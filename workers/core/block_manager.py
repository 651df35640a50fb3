"""KV block allocation: pure bookkeeping, no tensors.

A block is free, owned (ref_count > 0: one or more live sequences read it), or, with prefix
caching, cached: full, hashed, unreferenced and kept in an LRU until its memory is needed.
Cached blocks count as free space; allocation takes truly free blocks first and only then
evicts the least recently used cached one.

With a host tier (`HostBlockPool`, the CPU offload), an evicted cached block is demoted there
by copy instead of dropped, and a prefix hit in the host tier is restored by copy into a device
block; a preempted sequence can be swapped out whole and back in. Copies are queued in a
`KVCopyPlan` that the engine runs once per step (`take_copy_plan` / `copies_done`).
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass

from workers.core.host_block_pool import HostBlockPool
from workers.core.kv_events import KVCopyPlan, KVEvents


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    block_hash: bytes | None = None  # set once the block is full, for prefix caching
    token_ids: tuple[int, ...] | None = None  # its tokens, to confirm a hash hit


class BlockManager:
    def __init__(
        self, num_blocks: int, block_size: int, enable_caching: bool = False,
        host: HostBlockPool | None = None, events: KVEvents | None = None,
    ) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError("num_blocks and block_size must be positive")
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.host = host
        self.events = events or KVEvents()
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_ids: deque[int] = deque(range(num_blocks))
        self.cached: OrderedDict[int, None] = OrderedDict()  # unreferenced, LRU first
        self.by_hash: dict[bytes, int] = {}
        self.plan = KVCopyPlan()
        self.num_evicted = 0  # cached blocks reclaimed for new allocations
        self.num_offloaded = 0  # of which were demoted to the host tier
        self.num_restored = 0  # host-tier prefix hits copied back to the device
        self.num_swapped_out = 0  # blocks of preempted sequences copied to the host tier
        self.num_swapped_in = 0

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free(self) -> int:
        """Blocks an allocation can take: free ones and evictable cached ones."""
        return len(self.free_ids) + len(self.cached)

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
            block = self.blocks[self._take()]
            assert block.ref_count == 0, f"block {block.block_id} is free but referenced"
            block.ref_count = 1
            block_table.append(block.block_id)

    def _take(self) -> int:
        if self.free_ids:
            return self.free_ids.popleft()
        block_id, _ = self.cached.popitem(last=False)  # evict the least recently used
        self.num_evicted += 1
        self._demote(self.blocks[block_id])
        self._forget(self.blocks[block_id])
        return block_id

    def _demote(self, block: Block) -> None:
        if self.host is None or block.block_hash is None:
            return
        host_id = self.host.demote(block.block_hash, block.token_ids)
        if host_id is not None:
            self.plan.to_host.append((block.block_id, host_id))
            self.num_offloaded += 1

    def _forget(self, block: Block) -> None:
        if block.block_hash is not None and self.by_hash.get(block.block_hash) == block.block_id:
            del self.by_hash[block.block_hash]
            self.events.record("removed", "device", block.block_hash)
        block.block_hash, block.token_ids = None, None

    def deallocate(self, block_table: list[int]) -> None:
        """Release every block of `block_table` and empty it."""
        for block_id in reversed(block_table):
            block = self.blocks[block_id]
            assert block.ref_count > 0, f"double free of block {block_id}"
            block.ref_count -= 1
            if block.ref_count > 0:
                continue
            if self.enable_caching and block.block_hash is not None:
                self.cached[block_id] = None  # the most recently used end
            else:
                self._forget(block)
                self.free_ids.append(block_id)
        block_table.clear()

    def cache_block(self, block_id: int, block_hash: bytes, token_ids: Sequence[int]) -> None:
        """Mark a full block reusable under `block_hash` (first writer wins on duplicates)."""
        if not self.enable_caching or block_hash in self.by_hash:
            return
        block = self.blocks[block_id]
        block.block_hash, block.token_ids = block_hash, tuple(token_ids)
        self.by_hash[block_hash] = block_id
        self.events.record("stored", "device", block_hash)

    def match_prefix(self, hashes: Sequence[bytes], token_ids: Sequence[int]) -> list[int]:
        """Take a reference on the longest run of cached blocks for `hashes` (token ids
        confirmed) and return their ids, in order."""
        matched: list[int] = []
        for i, h in enumerate(hashes):
            chunk = tuple(token_ids[i * self.block_size:(i + 1) * self.block_size])
            block_id = self.by_hash.get(h)
            if block_id is None:
                block_id = self._restore(h, chunk)
            elif self.blocks[block_id].token_ids != chunk:
                block_id = None
            if block_id is None:
                break
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self.cached[block_id]
            block.ref_count += 1
            matched.append(block_id)
        return matched

    def _restore(self, block_hash: bytes, chunk: tuple[int, ...]) -> int | None:
        """Copy a host-tier hit into a device block, cached (unreferenced) under its hash."""
        if self.host is None or self.num_free == 0:
            return None
        host_id = self.host.lookup(block_hash, chunk)
        if host_id is None:
            return None
        block_id = self._take()
        self.plan.to_device.append((host_id, block_id))
        self.num_restored += 1
        self.cached[block_id] = None
        self.cache_block(block_id, block_hash, chunk)
        return block_id

    # -- swapping (preemption with a host tier) --------------------------------------------
    def can_swap_out(self, block_table: list[int]) -> bool:
        return self.host is not None and len(block_table) <= self.host.num_free

    def swap_out(self, block_table: list[int]) -> list[int]:
        """Queue copies of `block_table` to new host blocks (the caller then deallocates it)."""
        assert self.host is not None
        host_table = [self.host.take() for _ in block_table]
        assert None not in host_table, "swap_out without can_swap_out"
        self.plan.to_host += zip(block_table, host_table, strict=True)
        self.num_swapped_out += len(host_table)
        return host_table

    def swap_in(self, host_table: list[int], block_table: list[int]) -> None:
        """Queue copies back into the first blocks of the (allocated) `block_table`."""
        self.plan.to_device += zip(host_table, block_table[: len(host_table)], strict=True)
        self.plan.release_host += host_table
        self.num_swapped_in += len(host_table)

    def free_swapped(self, host_table: list[int]) -> None:
        """A swapped-out sequence ended before resuming (between steps: no copy pending)."""
        if self.host is not None:
            self.host.release(host_table)

    def take_copy_plan(self) -> KVCopyPlan:
        plan, self.plan = self.plan, KVCopyPlan()
        return plan

    def copies_done(self, plan: KVCopyPlan) -> None:
        if self.host is not None:
            self.host.release(plan.release_host)
            self.host.unpin_all()

    def cached_hashes(self) -> dict[str, list[bytes]]:
        """Tier -> hashes of the blocks a prefix hit can use there (for the cache manager)."""
        return {"device": list(self.by_hash), "host": self.host.hashes() if self.host else []}
