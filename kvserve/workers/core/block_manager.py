"""KV block allocation: pure bookkeeping, no tensors.

A block is free, owned (ref_count > 0: one or more live sequences read it), or, with prefix
caching, cached: full, hashed, unreferenced and kept in an LRU until its memory is needed.
Cached blocks count as free space; allocation takes truly free blocks first and only then
evicts the least recently used cached one.

With a host tier (`HostBlockPool`, the CPU offload), an evicted cached block is demoted there
by copy instead of dropped, and a prefix hit in the host tier is restored by copy into a device
block; a preempted sequence can be swapped out whole and back in. Copies are queued in a
`KVCopyPlan` that the engine runs once per step (`take_copy_plan` / `copies_done`).

Two levels, as vLLM v1 splits KVCacheManager from BlockPool. The per-request methods
(`get_computed_blocks`, `allocate_slots`, `admit`, `cache_full_blocks`, `preempt`, `free`) are
all the scheduler calls: this class alone computes prefix hashes, grows and empties a request's
`block_table` / `host_table` and counts prefix-cache hits, and the scheduler only learns small
results (a `KVCacheBlocks`, a token count, whether a preemption swapped). The list-level
primitives under them (`allocate(block_table, n)`, `deallocate`, `match_prefix`, `swap_out`,
...) are the pool itself, kept public for the block-accounting unit tests.

With a sliding window on every layer (`sliding_window`: Mistral), a running request's blocks
that the window has left are freed while it runs (`allocate_slots` slides first): its table
keeps their places as NO_BLOCK, and a request holds at most ceil(window / block_size) + 1
blocks while it decodes (vLLM's SlidingWindowManager). A full block freed so goes to the prefix
cache like any other, kept for a later request with the same prefix.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvserve.workers.core.free_blocks import FreeBlocks
from kvserve.workers.core.host_block_pool import HostBlockPool
from kvserve.workers.core.kv_events import KVCopyPlan, KVEvents
from kvserve.workers.core.outputs import KVManagerStats
from kvserve.workers.core.prefix_hash import extend_block_hashes
from kvserve.workers.core.timeline import BlockActivity

if TYPE_CHECKING:  # only its attributes are used here; sequence.py imports torch
    from kvserve.workers.core.sequence import Sequence as Request


NO_BLOCK = -1  # a table entry whose block was freed behind the sliding window


def held(table: Sequence[int]) -> int:
    """The blocks a block table (or host table) holds: its entries, less those freed behind a
    sliding window."""
    return len(table) - table.count(NO_BLOCK) if table and table[0] == NO_BLOCK else len(table)


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    block_hash: bytes | None = None  # set once the block is full, for prefix caching
    token_ids: tuple[int, ...] | None = None  # its tokens, to confirm a hash hit


@dataclass(frozen=True)
class KVCacheBlocks:
    """What an allocation gave a request (vLLM v1's KVCacheBlocks): the ids of the blocks it
    added, in table order. A copy: the request's table itself stays the KV manager's to change."""

    block_ids: tuple[int, ...]


class BlockManager:
    def __init__(
        self, num_blocks: int, block_size: int, enable_caching: bool = False,
        host: HostBlockPool | None = None, events: KVEvents | None = None,
        sliding_window: int | None = None, max_step_tokens: int | None = None,
    ) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError("num_blocks and block_size must be positive")
        self.block_size = block_size
        # every layer's window (the widest, in tokens): blocks behind it are freed; None: none
        self.sliding_window = sliding_window
        self.max_step_tokens = max_step_tokens  # the most tokens a request computes in a step
        self.enable_caching = enable_caching
        self.host = host
        self.events = events or KVEvents()
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_ids = FreeBlocks(num_blocks)  # the block freed last is taken first
        self.cached: OrderedDict[int, None] = OrderedDict()  # unreferenced, LRU first
        self.by_hash: dict[bytes, int] = {}
        self.plan = KVCopyPlan()
        self.num_evicted = 0  # cached blocks reclaimed for new allocations
        self.num_offloaded = 0  # of which were demoted to the host tier
        self.num_restored = 0  # host-tier prefix hits copied back to the device
        self.num_swapped_out = 0  # blocks of preempted sequences copied to the host tier
        self.num_swapped_in = 0
        self.prefix_queried_tokens = 0  # prompt tokens looked up in the prefix cache
        self.prefix_hit_tokens = 0  # of which were found cached
        # per request, the blocks it gained and lost since the engine last took them (the
        # step timeline); off, the per-request methods count nothing
        self.track_activity = True
        self.activity: dict[str, BlockActivity] = {}

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free(self) -> int:
        """Blocks an allocation can take: free ones and evictable cached ones."""
        return len(self.free_ids) + len(self.cached)

    def usage(self) -> float:
        return 1.0 - self.num_free / self.num_blocks

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks that hold `num_tokens` tokens (a request at its longest: the pool must have
        that many for the request to ever finish)."""
        return -(-num_tokens // self.block_size)

    def blocks_at_most(self, num_tokens: int) -> int:
        """The most blocks a request of `num_tokens` tokens holds at once: all of them; with
        a sliding window (and `max_step_tokens`), at most its window's and one step's: a step
        of q tokens after c reads c - window + 1 .. c + q - 1, ceil((window - 1 + q) /
        block_size) + 1 blocks (ceil(window / block_size) + 1 while it decodes)."""
        full = self.blocks_for(num_tokens)
        if not self.sliding_window or not self.max_step_tokens:
            return full
        span = self.sliding_window - 1 + self.max_step_tokens
        return min(full, -(-span // self.block_size) + 1)

    def blocks_needed(self, block_table: list[int], num_tokens: int, first: int = 0) -> int:
        """Blocks to add so that `block_table` holds `num_tokens` tokens (from its block
        `first` on: the places before it are NO_BLOCK)."""
        return max(0, -(-num_tokens // self.block_size) - max(len(block_table), first))

    def can_allocate(self, block_table: list[int], num_tokens: int, first: int = 0) -> bool:
        return self.blocks_needed(block_table, num_tokens, first) <= self.num_free

    def allocate(self, block_table: list[int], num_tokens: int, first: int = 0) -> None:
        """Grow `block_table` in place to hold `num_tokens` tokens; places before block
        `first` (behind a sliding window) get NO_BLOCK, not a block."""
        needed = self.blocks_needed(block_table, num_tokens, first)
        if needed > self.num_free:
            raise MemoryError(f"need {needed} KV blocks, {self.num_free} free")
        block_table += [NO_BLOCK] * (first - len(block_table))
        for _ in range(needed):
            block = self.blocks[self._take()]
            assert block.ref_count == 0, f"block {block.block_id} is free but referenced"
            block.ref_count = 1
            block_table.append(block.block_id)

    def _take(self) -> int:
        if self.free_ids:
            return self.free_ids.take()
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
            if block_id == NO_BLOCK:
                continue
            block = self.blocks[block_id]
            assert block.ref_count > 0, f"double free of block {block_id}"
            block.ref_count -= 1
            if block.ref_count > 0:
                continue
            if self.enable_caching and block.block_hash is not None:
                self.cached[block_id] = None  # the most recently used end
            else:
                self._forget(block)
                self.free_ids.put([block_id])
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

    # -- per request: all the scheduler calls -----------------------------------------------
    def get_computed_blocks(self, seq: Request) -> int:
        """Start a waiting `seq` that holds no KV on the longest cached run of its full blocks
        and return its computed tokens. Its last token is always recomputed (its logits give
        the next token). Without prefix caching, or when `seq` already holds blocks or swapped
        KV, nothing changes."""
        if self.enable_caching and not seq.block_table and not seq.host_table:
            usable = (seq.num_tokens - 1) // self.block_size
            extend_block_hashes(seq.block_hashes, seq.token_ids, self.block_size, usable,
                                seq.cache_salt)
            before = self._traffic()
            seq.block_table = self.match_prefix(seq.block_hashes[:usable], seq.token_ids)
            self._note(seq, before)
            seq.num_cached_blocks = len(seq.block_table)
            seq.num_computed_tokens = seq.num_cached_blocks * self.block_size
        return seq.num_computed_tokens

    def release_computed_blocks(self, seq: Request) -> None:
        """`seq` stays waiting (no room this step): drop its hold on the cached blocks that
        `get_computed_blocks` gave it (they stay cached). Swapped-out KV stays in the host tier."""
        if seq.host_table:
            return
        self.deallocate(seq.block_table)
        seq.num_computed_tokens = seq.num_cached_blocks = 0

    def allocate_slots(self, seq: Request, num_tokens: int) -> KVCacheBlocks | None:
        """Grow `seq`'s table to hold `num_tokens` tokens; None, with nothing more changed,
        when the pool (free and evictable cached blocks) has too few. With a sliding window
        the blocks behind it are freed first (`slide`)."""
        first = self.slide(seq)
        if not self.can_allocate(seq.block_table, num_tokens, first):
            return None
        start, before = max(len(seq.block_table), first), self._traffic()
        self.allocate(seq.block_table, num_tokens, first)
        if len(seq.block_table) > start:
            self._note(seq, before, allocated=len(seq.block_table) - start)
        return KVCacheBlocks(tuple(seq.block_table[start:]))

    def window_start(self, num_computed_tokens: int) -> int:
        """The first block a request with `num_computed_tokens` tokens in the cache still
        reads: its next query, at position num_computed_tokens, sees the keys from
        num_computed_tokens - window + 1 on. 0 without a sliding window."""
        if not self.sliding_window:
            return 0
        return max(0, num_computed_tokens - self.sliding_window + 1) // self.block_size

    def slide(self, seq: Request) -> int:
        """Free `seq`'s blocks that have left the sliding window (each full one stays in the
        prefix cache, as a finished request's would) and return the window's first block.
        Their places become NO_BLOCK, a run from the table's start: a walk back from the
        window stops at the first one already freed."""
        first = self.window_start(seq.num_computed_tokens)
        table, left = seq.block_table, []
        i = min(first, len(table)) - 1
        while i >= 0 and table[i] != NO_BLOCK:
            left.append(table[i])
            table[i] = NO_BLOCK
            i -= 1
        if left:
            self._note(seq, None, freed=len(left))
            self.deallocate(left[::-1])  # the earliest blocks stay cached the longest
        return first

    def trim(self, seq: Request, num_tokens: int) -> None:
        """Shrink `seq`'s table to the blocks `num_tokens` tokens fill: the slots of rejected
        speculative drafts are given up, and a block that only they used goes back to the
        pool (it was never full of accepted tokens, so it holds no prefix-cache entry)."""
        keep = self.blocks_for(num_tokens)
        if len(seq.block_table) > keep:
            tail = seq.block_table[keep:]
            del seq.block_table[keep:]
            self._note(seq, None, freed=len(tail))
            self.deallocate(tail)

    def admit(self, seq: Request) -> None:
        """`seq` got its blocks and leaves the waiting queue. Its prefix-cache query is counted
        once per request (a resume after preemption is not a new query), and a swapped-out
        sequence's KV is queued to come back into its first blocks."""
        if self.enable_caching and not seq.num_preemptions:
            self.prefix_queried_tokens += seq.num_tokens
            self.prefix_hit_tokens += seq.num_computed_tokens
            seq.num_cached_prompt_tokens = seq.num_computed_tokens
            if seq.num_cached_blocks:
                self._note(seq, None, hit=seq.num_cached_blocks)
        if seq.host_table:
            self.swap_in(seq.host_table, seq.block_table)
            self._note(seq, None, swapped_in=held(seq.host_table))
            seq.host_table = []

    def cache_full_blocks(self, seq: Request) -> None:
        """After a step: register the blocks of `seq` it filled, so later requests reuse them
        (vLLM's BlockPool.cache_full_blocks)."""
        if not self.enable_caching:
            return
        size = self.block_size
        full = seq.num_computed_tokens // size
        extend_block_hashes(seq.block_hashes, seq.token_ids, size, full, seq.cache_salt)
        for i in range(seq.num_cached_blocks, full):
            if seq.block_table[i] != NO_BLOCK:
                self.cache_block(seq.block_table[i], seq.block_hashes[i],
                                 seq.token_ids[i * size:(i + 1) * size])
        seq.num_cached_blocks = max(seq.num_cached_blocks, full)

    def preempt(self, seq: Request) -> bool:
        """Free `seq`'s device blocks. True when its KV was swapped out to the host tier (it
        resumes where it was); False when the host tier is off or full (it is recomputed)."""
        swapped = self.can_swap_out(seq.block_table)
        if swapped:
            seq.host_table = self.swap_out(seq.block_table)
        self._note(seq, None, freed=held(seq.block_table), swapped_out=held(seq.host_table))
        self.deallocate(seq.block_table)
        return swapped

    def free(self, seq: Request) -> None:
        """`seq` ended (finished or aborted): every block it holds, in either tier, is freed."""
        self._note(seq, None, freed=held(seq.block_table) + held(seq.host_table))
        self.deallocate(seq.block_table)
        self.free_swapped(seq.host_table)
        seq.host_table = []

    def touched_blocks(self) -> int:
        """Blocks ever written, both tiers: a CPU pool's pages in RAM (`FreeBlocks`). Cheap:
        the engine's load reads it on every streamed token."""
        return self.free_ids.num_touched + (self.host.num_touched if self.host else 0)

    def stats(self) -> KVManagerStats:
        host = self.host
        return KVManagerStats(
            device_blocks=self.num_blocks, device_used=self.num_blocks - self.num_free,
            device_cached=len(self.cached), host_blocks=host.num_blocks if host else 0,
            host_used=host.num_used if host else 0, host_cached=len(host.cached) if host else 0,
            prefix_queried_tokens=self.prefix_queried_tokens,
            prefix_hit_tokens=self.prefix_hit_tokens, blocks_offloaded=self.num_offloaded,
            blocks_restored=self.num_restored, blocks_swapped_out=self.num_swapped_out,
            blocks_swapped_in=self.num_swapped_in, device_touched=self.free_ids.num_touched,
            host_touched=host.num_touched if host else 0,
        )

    def take_activity(self) -> dict[str, BlockActivity]:
        """Request id -> the blocks it gained and lost since the last call (the step record)."""
        activity, self.activity = self.activity, {}
        return activity

    def _traffic(self) -> tuple[int, int, int]:
        return self.num_evicted, self.num_offloaded, self.num_restored

    def _note(self, seq: Request, before: tuple[int, int, int] | None, **counts: int) -> None:
        """Add to `seq`'s activity: `counts`, and the evictions, demotions and restores since
        `before` (a `_traffic()` taken before the call that may have caused them)."""
        if not self.track_activity:
            return
        if before is not None:
            evicted, demoted, restored = (now - then for now, then
                                          in zip(self._traffic(), before, strict=True))
            counts = {**counts, "evicted": evicted, "demoted": demoted, "restored": restored}
        counts = {k: v for k, v in counts.items() if v}
        if not counts:
            return
        activity = self.activity.get(seq.request_id)
        if activity is None:
            activity = self.activity[seq.request_id] = BlockActivity()
        for name, n in counts.items():
            setattr(activity, name, getattr(activity, name) + n)

    # -- swapping (preemption with a host tier) --------------------------------------------
    def can_swap_out(self, block_table: list[int]) -> bool:
        return self.host is not None and held(block_table) <= self.host.num_free

    def swap_out(self, block_table: list[int]) -> list[int]:
        """Queue copies of `block_table` to new host blocks (the caller then deallocates it);
        a place freed behind the window stays NO_BLOCK in the host table."""
        assert self.host is not None
        host_table = [NO_BLOCK if b == NO_BLOCK else self.host.take() for b in block_table]
        assert None not in host_table, "swap_out without can_swap_out"
        pairs = [(b, h) for b, h in zip(block_table, host_table, strict=True) if b != NO_BLOCK]
        self.plan.to_host += pairs
        self.num_swapped_out += len(pairs)
        return host_table

    def swap_in(self, host_table: list[int], block_table: list[int]) -> None:
        """Queue copies back into the first blocks of the (allocated) `block_table`. A block
        the window left while the request waited has no place there: it is released unread."""
        pairs = [(h, b) for h, b in zip(host_table, block_table[: len(host_table)], strict=True)
                 if h != NO_BLOCK and b != NO_BLOCK]
        self.plan.to_device += pairs
        self.plan.release_host += [h for h in host_table if h != NO_BLOCK]
        self.num_swapped_in += len(pairs)

    def free_swapped(self, host_table: list[int]) -> None:
        """A swapped-out sequence ended before resuming (between steps: no copy pending)."""
        if self.host is not None:
            self.host.release([h for h in host_table if h != NO_BLOCK])

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
