"""KVCopier (kv_transfer.py): a step's block copies between the device pool and the host
tier. On CPU: results equal `copy_blocks`, for the plain path and for the staged algorithm that
CUDA runs (with no-op streams and events), staging slots are reused and grown, and deferred
device->host scatters land in order. On CUDA (marked `gpu`): pinned memory, a side stream,
the events that order it against the model's stream (with negative controls), no host sync on
the host->device path."""

from __future__ import annotations

import random
import time

import pytest
import torch

from kvserve.workers.core.kv_events import KVCopyPlan
from kvserve.workers.model_executor.kv_cache import (
    KVCache,
    KVCacheSpec,
    allocate_kv_cache,
    copy_blocks,
)
from kvserve.workers.model_executor.kv_transfer import KVCopier

SPEC = KVCacheSpec(num_layers=2, num_kv_heads=2, head_dim=8, block_size=4, dtype=torch.float32)
DEVICE_BLOCKS, HOST_BLOCKS = 12, 10


def random_cache(num_blocks: int, device: str = "cpu", pin: bool = False,
                 seed: int = 0) -> KVCache:
    cache = allocate_kv_cache(SPEC, num_blocks, torch.device(device), pin_memory=pin)
    gen = torch.Generator().manual_seed(seed)
    for kv in cache:
        for t in kv:
            t.copy_(torch.randn(t.shape, generator=gen))
    return cache


def clone(cache: KVCache) -> KVCache:
    return [(k.clone(), v.clone()) for k, v in cache]


def assert_same(a: KVCache, b: KVCache) -> None:
    for (ka, va), (kb, vb) in zip(a, b, strict=True):
        torch.testing.assert_close(ka.cpu(), kb.cpu(), rtol=0, atol=0)
        torch.testing.assert_close(va.cpu(), vb.cpu(), rtol=0, atol=0)


def reference(device: KVCache, host: KVCache, plan: KVCopyPlan) -> None:
    """The old synchronous semantics: every device->host copy, then every host->device one."""
    copy_blocks(device, [d for d, _ in plan.to_host], host, [h for _, h in plan.to_host])
    copy_blocks(host, [h for h, _ in plan.to_device], device, [d for _, d in plan.to_device])


def random_plan(rng: random.Random) -> KVCopyPlan:
    """Distinct destinations per direction; a refilled device block may be one swapped out in
    the same step, and a restored host block may be one written in the same step."""
    n_out = rng.randint(0, 6)
    n_in = rng.randint(0, 6)
    to_host = list(zip(rng.sample(range(DEVICE_BLOCKS), n_out),
                       rng.sample(range(HOST_BLOCKS), n_out), strict=True))
    to_device = list(zip(rng.sample(range(HOST_BLOCKS), n_in),
                         rng.sample(range(DEVICE_BLOCKS), n_in), strict=True))
    return KVCopyPlan(to_host=to_host, to_device=to_device)


# -- CPU: results ---------------------------------------------------------------------------


@pytest.mark.parametrize(("staged", "chunk_blocks", "max_slots"),
                         [(False, None, 8), (True, None, 8), (True, 2, 2), (True, 1, 1)])
@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_random_plans_copy_like_copy_blocks(staged, chunk_blocks, max_slots, seed) -> None:
    rng = random.Random(seed)
    device, host = random_cache(DEVICE_BLOCKS, seed=seed), random_cache(HOST_BLOCKS, seed=99)
    ref_device, ref_host = clone(device), clone(host)
    copier = KVCopier(device, host, staged=staged, chunk_blocks=chunk_blocks,
                      max_slots=max_slots)
    for _ in range(25):
        plan = random_plan(rng)
        copier.copy(plan)
        reference(ref_device, ref_host, plan)
        assert_same(device, ref_device)  # what the model reads next
        if rng.random() < 0.3:
            copier.flush()
            assert_same(host, ref_host)
    copier.flush()
    assert_same(host, ref_host)
    assert not copier.pending


def test_block_restored_in_the_step_that_demotes_it() -> None:
    """Demoted to host block 5 and restored from it (into another device block) in one plan:
    the restore sees the demoted contents, not what host block 5 held before."""
    device, host = random_cache(DEVICE_BLOCKS, seed=1), random_cache(HOST_BLOCKS, seed=2)
    before = [(k[3].clone(), v[3].clone()) for k, v in device]
    copier = KVCopier(device, host, staged=True)
    copier.copy(KVCopyPlan(to_host=[(3, 5)], to_device=[(5, 7)]))
    for (k, v), (k3, v3) in zip(device, before, strict=True):
        assert torch.equal(k[7], k3) and torch.equal(v[7], v3)
    assert not copier.pending  # that case lands in the host tier at once
    assert torch.equal(host[0][0][5], before[0][0])


def test_swap_out_then_refill_same_device_block_in_one_step() -> None:
    device, host = random_cache(DEVICE_BLOCKS, seed=3), random_cache(HOST_BLOCKS, seed=4)
    old = device[1][1][2].clone()
    copier = KVCopier(device, host, staged=True)
    copier.copy(KVCopyPlan(to_host=[(2, 0)], to_device=[(4, 2)]))
    assert torch.equal(device[1][1][2], host[1][1][4])  # refilled
    copier.flush()
    assert torch.equal(host[1][1][0], old)  # and the swap-out read it before


def test_cpu_default_is_the_plain_path() -> None:
    copier = KVCopier(random_cache(4), random_cache(4))
    assert not copier.staged and copier.stream is None
    copier.copy(KVCopyPlan(to_host=[(0, 1)], to_device=[(2, 3)]))
    assert not copier.slots and not copier.pending  # no staging, nothing deferred


def test_model_runner_owns_a_copier_and_delegates() -> None:
    from kvserve.workers.model_executor.model_runner import ModelRunner

    runner = ModelRunner(None, SPEC, 6, None, None, torch.device("cpu"), num_host_blocks=4)
    assert runner.copier.device_cache is runner.kv_cache
    assert runner.copier.host_cache is runner.host_kv_cache
    runner.kv_cache[0][0][1].fill_(3.0)
    runner.copy(KVCopyPlan(to_host=[(1, 2)]))
    assert torch.all(runner.host_kv_cache[0][0][2] == 3.0)


# -- CPU: staging slots ---------------------------------------------------------------------


class FakeEvent:
    """A controllable event: `done` says whether the DMA it marks has completed."""

    def __init__(self) -> None:
        self.done = True
        self.records = 0
        self.syncs = 0

    def record(self, stream: object = None) -> None:
        self.records += 1

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.syncs += 1
        self.done = True


def fake_events(copier: KVCopier, monkeypatch) -> list[FakeEvent]:
    made: list[FakeEvent] = []
    new_slot = copier._new_slot

    def new_slot_with_fake_event(n: int):
        slot = new_slot(n)
        slot.event = FakeEvent()
        made.append(slot.event)
        return slot

    monkeypatch.setattr(copier, "_new_slot", new_slot_with_fake_event)
    return made


def h2d(*pairs: tuple[int, int]) -> KVCopyPlan:
    return KVCopyPlan(to_device=list(pairs))


def test_staging_is_reused_and_grows_to_powers_of_two() -> None:
    copier = KVCopier(random_cache(DEVICE_BLOCKS), random_cache(HOST_BLOCKS), staged=True)
    copier.copy(h2d((0, 0), (1, 1), (2, 2)))
    assert copier.staging_capacity() == [4]
    slot = copier.slots[0]
    ptr = slot.data.data_ptr()
    copier.copy(h2d((3, 3), (4, 4)))
    assert copier.slots[0] is slot and slot.data.data_ptr() == ptr  # reused, not reallocated
    dev_ptr = copier._dev["h2d"].data_ptr()
    copier.copy(h2d(*[(i, i) for i in range(9)]))
    assert copier.staging_capacity() == [16] and copier.slots[0] is slot  # grown in place
    assert copier._dev["h2d"].data_ptr() != dev_ptr  # the device staging grew too
    copier.copy(h2d((0, 1)))
    assert copier.staging_capacity() == [16]  # never shrinks
    assert copier._dev["h2d"].numel() == 16 * copier.num_tensors * copier.block_elems


def test_staging_is_bounded_by_the_chunk_size() -> None:
    device, host = random_cache(DEVICE_BLOCKS, seed=8), random_cache(HOST_BLOCKS, seed=9)
    copier = KVCopier(device, host, staged=True, chunk_blocks=3, max_slots=2)
    plan = KVCopyPlan(to_host=[(i, i) for i in range(10)],
                      to_device=[(i, (i + 1) % DEVICE_BLOCKS) for i in range(7)])
    ref_device, ref_host = clone(device), clone(host)
    copier.copy(plan)
    reference(ref_device, ref_host, plan)
    copier.flush()
    assert_same(device, ref_device)
    assert_same(host, ref_host)
    assert copier.staging_capacity() == [3, 3]  # 4 rounded to the chunk, 2 slots
    per_block = copier.num_tensors * copier.block_elems
    assert {k: b.numel() for k, b in copier._dev.items() if k in ("h2d", "d2h")} == {
        "h2d": 3 * per_block, "d2h": 3 * per_block}


def test_chunk_size_comes_from_a_byte_budget() -> None:
    from kvserve.workers.model_executor.kv_transfer import STAGING_BYTES

    copier = KVCopier(random_cache(2), random_cache(2))
    assert copier.chunk_blocks == STAGING_BYTES // SPEC.bytes_per_block


def test_a_slot_in_flight_is_not_rewritten(monkeypatch) -> None:
    device, host = random_cache(DEVICE_BLOCKS), random_cache(HOST_BLOCKS, seed=5)
    copier = KVCopier(device, host, staged=True, max_slots=2)
    events = fake_events(copier, monkeypatch)
    copier.copy(h2d((0, 0)))
    first = copier.slots[0]
    events[0].done = False  # its DMA still reads the pinned buffer
    copier.copy(h2d((1, 1)))
    assert len(copier.slots) == 2 and copier.slots[-1] is not first  # a second slot
    events[1].done = False
    copier.copy(h2d((2, 2)))  # both in flight, at the cap: wait for the least recently used
    assert events[0].syncs == 1 and events[1].syncs == 0 and copier.slots[-1] is first
    assert torch.equal(device[0][0][2], host[0][0][2])


def test_device_to_host_lands_later_in_fifo_order(monkeypatch) -> None:
    device, host = random_cache(DEVICE_BLOCKS, seed=6), random_cache(HOST_BLOCKS, seed=7)
    copier = KVCopier(device, host, staged=True, max_slots=3)
    events = fake_events(copier, monkeypatch)
    first, second = device[0][0][1].clone(), device[0][0][2].clone()
    copier.copy(KVCopyPlan(to_host=[(1, 6)]))
    events[0].done = False  # the D2H DMA has not completed: host block 6 must not be written
    assert not torch.equal(host[0][0][6], first) and len(copier.pending) == 1
    copier.copy(KVCopyPlan(to_host=[(2, 6)]))  # host block 6 reused (the first owner ended)
    assert len(copier.pending) == 2 and events[0].syncs == 0  # no waiting on the way
    events[1].done = False
    events[0].done = True
    copier.copy(KVCopyPlan(to_device=[(0, 0)]))  # finishes what has landed, without blocking
    assert len(copier.pending) == 1 and torch.equal(host[0][0][6], first)
    copier.copy(KVCopyPlan(to_device=[(6, 5)]))  # reads host block 6: its transfer must land
    assert not copier.pending and events[1].syncs == 1
    assert torch.equal(host[0][0][6], second) and torch.equal(device[0][0][5], second)


# -- CUDA (run by the GPU check) ------------------------------------------------------------

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
SLEEP_CYCLES = 500_000_000  # ~0.25 s at an H200's ~2 GHz SM clock


def cuda_pair(seed: int = 0) -> tuple[KVCache, KVCache]:
    """A zeroed device pool and a random pinned host tier."""
    device = allocate_kv_cache(SPEC, DEVICE_BLOCKS, torch.device("cuda"))
    return device, random_cache(HOST_BLOCKS, pin=True, seed=seed)


def slow_side_stream(copier: KVCopier) -> None:
    """Make the side stream busy so that its copies run long after `copy` returns."""
    assert copier.stream is not None
    with torch.cuda.stream(copier.stream):
        torch.cuda._sleep(SLEEP_CYCLES)


def busy_copier() -> tuple[KVCache, KVCache, KVCopier]:
    """A device pool, a host tier, and a copier whose side stream is busy (copies lag)."""
    device, host = cuda_pair()
    copier = KVCopier(device, host)
    slow_side_stream(copier)
    return device, host, copier


def read_refilled(device: KVCache, ids: list[int]) -> torch.Tensor:
    """A model read on the current (compute) stream: layer 0's K of blocks `ids`, to host."""
    k = device[0][0]
    got = torch.stack([k[i] for i in ids])  # a kernel on the compute stream, enqueued now
    torch.cuda.synchronize()
    return got.cpu()


@pytest.mark.gpu
@needs_cuda
def test_cuda_host_tier_and_staging_are_pinned_and_copies_use_a_side_stream() -> None:
    from kvserve.workers.model_executor.model_runner import ModelRunner

    runner = ModelRunner(None, SPEC, DEVICE_BLOCKS, None, None, torch.device("cuda"),
                         num_host_blocks=HOST_BLOCKS)
    assert all(t.is_pinned() for kv in runner.host_kv_cache for t in kv)
    copier = runner.copier
    assert copier.staged and copier.stream is not None
    assert copier.stream.cuda_stream != torch.cuda.default_stream().cuda_stream
    assert copier.stream.cuda_stream != torch.cuda.current_stream().cuda_stream
    runner.copy(KVCopyPlan(to_host=[(0, 1), (2, 3)], to_device=[(4, 5)]))
    runner.copier.flush()
    assert len(copier.slots) == 2
    assert all(s.data.is_pinned() and s.index.is_pinned() for s in copier.slots)
    assert all(b.is_cuda for b in copier._dev.values())
    torch.cuda.synchronize()


@pytest.mark.gpu
@needs_cuda
def test_cuda_compute_stream_waits_for_host_to_device_copies() -> None:
    device, host, copier = busy_copier()
    copier.copy(h2d((1, 2), (3, 4)))
    got = read_refilled(device, [2, 4])
    assert torch.equal(got, torch.stack([host[0][0][1], host[0][0][3]]))


@pytest.mark.gpu
@needs_cuda
def test_cuda_negative_control_without_the_event_the_read_is_stale(monkeypatch) -> None:
    """The same read with the compute stream's wait removed sees the zeros still there: the
    copies really run on another stream, and the event is what makes the test above pass."""
    device, host = cuda_pair()
    copier = KVCopier(device, host)
    monkeypatch.setattr(copier, "_order_compute", lambda compute: None)
    slow_side_stream(copier)
    copier.copy(h2d((1, 2), (3, 4)))
    got = read_refilled(device, [2, 4])
    assert torch.count_nonzero(got) == 0, "the read should have raced the slow side stream"
    torch.cuda.synchronize()
    assert torch.equal(device[0][0][2].cpu(), host[0][0][1])  # the copy itself did happen


@pytest.mark.gpu
@needs_cuda
def test_cuda_side_stream_waits_for_the_previous_step_to_write_blocks() -> None:
    """Edge A: a swap-out of a block the previous step's model is still writing copies what
    the model wrote."""
    device, host = cuda_pair()
    copier = KVCopier(device, host)
    torch.cuda._sleep(SLEEP_CYCLES)  # a slow model step on the compute stream ...
    device[0][0][3].fill_(7.0)  # ... that writes block 3
    copier.copy(KVCopyPlan(to_host=[(3, 0)]))
    copier.flush()
    assert torch.all(host[0][0][0] == 7.0)


@pytest.mark.gpu
@needs_cuda
def test_cuda_model_write_after_swap_out_does_not_corrupt_it() -> None:
    """Edge R for device->host: a device block swapped out this step and overwritten by this
    step's model (reallocated) is gathered first."""
    device, host = cuda_pair()
    device[0][0][3].fill_(5.0)
    copier = KVCopier(device, host)
    slow_side_stream(copier)
    copier.copy(KVCopyPlan(to_host=[(3, 0)]))
    device[0][0][3].fill_(-1.0)  # the model writes the reallocated block
    copier.flush()
    assert torch.all(host[0][0][0] == 5.0)
    torch.cuda.synchronize()


@pytest.mark.gpu
@needs_cuda
def test_cuda_host_to_device_path_never_synchronizes() -> None:
    device, host, copier = busy_copier()
    torch.cuda.set_sync_debug_mode("error")
    try:
        start = time.perf_counter()
        for n in (3, 2, 9, 1):  # grow, reuse, grow, reuse
            copier.copy(h2d(*[(i, (i + 5) % DEVICE_BLOCKS) for i in range(n)]))
        elapsed = time.perf_counter() - start
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert elapsed < 0.1, f"copy waited for the slow side stream ({elapsed:.3f} s)"
    got = read_refilled(device, [5])
    assert torch.equal(got[0], host[0][0][0])
