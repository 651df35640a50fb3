"""The block manager (kvserve/workers/core/block_manager.py): block tables grow to cover the
tokens, never shrink while a sequence lives, never share a block between two live tables
(prefix caching aside: tests/test_prefix_caching.py), and a failed allocation changes nothing.
The same ledger under random engine traffic: tests/test_block_accounting.py."""

from __future__ import annotations

import math

import pytest

from kvserve.workers.core.block_manager import BlockManager, KVCacheBlocks
from tests.helpers import make_seq


@pytest.mark.parametrize("num_tokens", [0, 1, 3, 4, 5, 8, 9, 16, 17, 40])
def test_allocate_grows_table_to_ceil(num_tokens: int) -> None:
    bm = BlockManager(num_blocks=10, block_size=4)
    table: list[int] = []
    bm.allocate(table, num_tokens)
    assert len(table) == math.ceil(num_tokens / 4)
    assert len(set(table)) == len(table)
    assert bm.num_free == 10 - len(table)
    assert all(bm.blocks[b].ref_count == 1 for b in table)


def test_allocate_is_incremental_and_never_shrinks() -> None:
    bm = BlockManager(num_blocks=8, block_size=4)
    table: list[int] = []
    bm.allocate(table, 3)
    first = list(table)
    assert len(first) == 1
    bm.allocate(table, 4)  # still fits the first block
    assert table == first
    bm.allocate(table, 9)
    assert table[:1] == first and len(table) == 3
    bm.allocate(table, 2)  # fewer tokens than held: nothing changes
    assert len(table) == 3 and bm.num_free == 5
    assert bm.blocks_needed(table, 13) == 1
    assert bm.blocks_needed(table, 12) == 0


def test_two_tables_get_disjoint_blocks() -> None:
    bm = BlockManager(num_blocks=6, block_size=2)
    a: list[int] = []
    b: list[int] = []
    bm.allocate(a, 5)
    bm.allocate(b, 6)
    assert not set(a) & set(b)
    assert bm.num_free == 0


def test_memory_error_when_exhausted_leaves_state_untouched() -> None:
    bm = BlockManager(num_blocks=3, block_size=4)
    table: list[int] = []
    bm.allocate(table, 8)
    assert bm.can_allocate(table, 12)
    assert not bm.can_allocate(table, 13)
    before = list(table)
    with pytest.raises(MemoryError):
        bm.allocate(table, 13)
    assert table == before
    assert bm.num_free == 1
    other: list[int] = []
    with pytest.raises(MemoryError):
        bm.allocate(other, 5)
    assert other == [] and bm.num_free == 1


def test_deallocate_frees_everything_and_double_free_asserts() -> None:
    bm = BlockManager(num_blocks=4, block_size=4)
    table: list[int] = []
    bm.allocate(table, 10)
    held = list(table)
    for b in held:
        bm.blocks[b].block_hash = b"x"
    bm.deallocate(table)
    assert table == []
    assert bm.num_free == 4
    assert sorted(bm.free_ids) == [0, 1, 2, 3]
    assert all(bm.blocks[b].ref_count == 0 and bm.blocks[b].block_hash is None for b in held)
    stale = list(held)
    with pytest.raises(AssertionError, match="double free"):
        bm.deallocate(stale)
    assert sorted(bm.free_ids) == [0, 1, 2, 3]  # the failed free did not duplicate ids


def test_usage() -> None:
    bm = BlockManager(num_blocks=8, block_size=2)
    assert bm.usage() == 0.0
    table: list[int] = []
    bm.allocate(table, 5)  # 3 blocks
    assert bm.usage() == pytest.approx(3 / 8)
    rest: list[int] = []
    bm.allocate(rest, 10)
    assert bm.usage() == 1.0
    bm.deallocate(table)
    assert bm.usage() == pytest.approx(5 / 8)


def test_allocate_slots_reports_the_added_blocks_and_changes_nothing_when_short() -> None:
    bm = BlockManager(num_blocks=4, block_size=4)
    a, b = make_seq("a", 6), make_seq("b", 9)
    got = bm.allocate_slots(a, 6)
    assert got is not None and got.block_ids == tuple(a.block_table) and len(a.block_table) == 2
    assert bm.allocate_slots(a, 8) == KVCacheBlocks(())  # still fits its two blocks
    assert bm.allocate_slots(b, 9) is None  # needs 3, 2 are free
    assert b.block_table == [] and bm.num_free == 2
    grown = bm.allocate_slots(a, 9)
    assert grown is not None and grown.block_ids == (a.block_table[2],)
    bm.free(a)
    assert a.block_table == [] and bm.num_free == 4


@pytest.mark.parametrize(("num_blocks", "block_size"), [(0, 4), (4, 0), (-1, 4)])
def test_rejects_nonpositive_sizes(num_blocks: int, block_size: int) -> None:
    with pytest.raises(ValueError):
        BlockManager(num_blocks, block_size)
