"""Moving KV blocks between the device pool and the host tier (`KVCopier`).

On CPU a step's copies are one `index_select` / `index_copy_` per tensor (`copy_blocks`).

On CUDA they run asynchronously on a side stream, through staging buffers, and are ordered
against the model's stream (the "compute" stream, current when `copy` is called) by events:

    compute: ..step k-1 model..[rec A]......................................[wait R] step k model
    side:                     [wait A] D2H gather, DMA [rec S] | H2D DMA [rec H], scatter [rec R]
    CPU:     gather H2D's host blocks into pinned staging ------^    (later: S done -> scatter)

Why each edge:
  * A (compute -> side): the previous step's model may still be writing (or reading) the
    device blocks this step swaps out or refills; the side stream touches them only after.
  * R (side -> compute): the model reads the refilled blocks, and may overwrite blocks just
    swapped out (a device block freed by a swap-out can be reallocated in the same step), so
    the compute stream waits, on the device, for every gather and scatter. The CPU never
    waits here.
  * Device -> host. A CUDA tensor can't be `index_select`ed into a host tensor, so the blocks
    are gathered into a device staging buffer (side stream), DMA'd non_blocking into a
    pinned staging slot, and scattered into the host tier on the CPU only once that DMA has
    completed (event S): writing the host tier earlier would copy garbage. The scatter is
    deferred: it runs when S has completed, at the start of a later `copy` (a non-blocking
    `query()`), and blocking (`S.synchronize()`) only when something must read those host
    blocks first: an H2D copy reading a host block still in flight (demoted and restored in
    the same step, or swapped out and straight back in), a staging slot needed with none
    free, or `flush()`. Pending scatters run in FIFO order, so a host block reused by a
    later swap-out ends up with the later contents. In the engine the wait is ~free: each
    step's sampling has synchronized the compute stream, which waited for R, after S.
  * Host -> device. The host blocks are gathered on the CPU into a pinned staging slot (so
    the host tier is no longer read once `copy` returns, and the caller may release those
    host blocks at once), DMA'd non_blocking to a device staging buffer on the side stream
    and scattered into the pool there. Neither the CPU nor the compute stream waits for it.
  * Staging. Copies move in chunks of at most `chunk_blocks` blocks (a byte budget), so
    staging memory is bounded whatever the plan: up to `max_slots` pinned slots (grown to
    the next power of two as needed, then reused) and one device buffer per direction. A
    slot is rewritten on the CPU only after the DMAs that read or write it have completed:
    its event (S or H) is recorded after them and checked with `query()`; only when every
    slot is in flight (a step moving more than `max_slots` chunks) does the CPU wait for the
    oldest. Device staging buffers belong to the side stream, so stream order protects their
    reuse.

`staged=True` on a CPU pool runs this same staged algorithm with no-op streams and events (and
unpinned slots), which is how CPU CI exercises the bookkeeping; results equal `copy_blocks`.
"""

from __future__ import annotations

import contextlib
import math
from collections import deque
from dataclasses import dataclass

import torch

from kvserve.workers.core.kv_events import KVCopyPlan
from kvserve.workers.model_executor.kv_cache import KVCache, copy_blocks

STAGING_BYTES = 32 * 1024**2  # per chunk: bounds each pinned slot and each device buffer


class _DoneEvent:
    """Stands in for a CUDA event on CPU: work is complete when it is issued."""

    def record(self, stream: object = None) -> None:
        pass

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass


def _next_pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


@dataclass(eq=False)  # identity, not field, equality (deque.remove)
class _Slot:
    """A host staging buffer: `data` flat [capacity * 2 * layers * block_elems] in the KV dtype,
    `index` [capacity] long (the device block ids that travel with it). `event` is recorded
    after the last DMA touching the slot; `pending` while a D2H transfer's scatter is owed."""

    data: torch.Tensor
    index: torch.Tensor
    event: torch.cuda.Event | _DoneEvent
    capacity: int
    pending: bool = False


@dataclass
class _PendingD2H:
    slot: _Slot
    host_ids: list[int]  # where the slot's n blocks go in the host tier


class KVCopier:
    """Runs a step's `KVCopyPlan` between `device_cache` and `host_cache` (see the module
    docstring for the ordering on CUDA). Owned by the `ModelRunner`."""

    def __init__(
        self, device_cache: KVCache, host_cache: KVCache, *, staged: bool | None = None,
        chunk_blocks: int | None = None, max_slots: int = 8,
    ) -> None:
        self.device_cache = device_cache
        self.host_cache = host_cache
        k0 = device_cache[0][0]  # [num_blocks, block_size, kv_heads, head_dim]
        self.device = k0.device
        self.cuda = self.device.type == "cuda"
        self.staged = self.cuda if staged is None else staged
        self.dtype = k0.dtype
        self.block_shape = tuple(k0.shape[1:])  # (block_size, kv_heads, head_dim)
        self.block_elems = math.prod(self.block_shape)
        self.num_tensors = 2 * len(device_cache)  # K and V per layer
        bytes_per_block = self.num_tensors * self.block_elems * k0.element_size()
        self.chunk_blocks = chunk_blocks or max(1, STAGING_BYTES // bytes_per_block)
        self.max_slots = max_slots
        self.slots: deque[_Slot] = deque()  # least recently used first
        self.pending: deque[_PendingD2H] = deque()  # D2H transfers whose scatter is owed
        self._dev: dict[str, torch.Tensor] = {}  # device staging, used on the side stream only
        self.stream: torch.cuda.Stream | None = None
        if self.cuda and self.staged:
            self.stream = torch.cuda.Stream(device=self.device)
            self._compute_done = torch.cuda.Event()  # A in the docstring
            self._copies_done = torch.cuda.Event()  # R

    # -- public ---------------------------------------------------------------------------
    @torch.inference_mode()
    def copy(self, plan: KVCopyPlan) -> None:
        """Device->host copies first (their device blocks may be refilled in this step), then
        host->device; the model's stream, current now, is ordered after both (on CUDA)."""
        to_host, to_device = plan.to_host, plan.to_device
        if not self.staged:
            copy_blocks(self.device_cache, [d for d, _ in to_host],
                        self.host_cache, [h for _, h in to_host])
            copy_blocks(self.host_cache, [h for h, _ in to_device],
                        self.device_cache, [d for _, d in to_device])
            return
        self._finish_d2h(block=False)  # scatters whose DMA has completed: no waiting
        if not (to_host or to_device):
            return
        compute = torch.cuda.current_stream(self.device) if self.stream is not None else None
        if self.stream is not None:
            self._compute_done.record(compute)
            self.stream.wait_event(self._compute_done)
        for chunk in self._chunks(to_host):
            self._device_to_host([d for d, _ in chunk], [h for _, h in chunk])
        host_src = [h for h, _ in to_device]
        if self._in_flight(host_src):
            # a host block the H2D gathers on the CPU is still being written (demoted and
            # restored in this step, or an earlier step's transfer not yet landed): this one
            # case waits for the device->host DMAs
            self._finish_d2h(block=True)
        for chunk in self._chunks(to_device):
            self._host_to_device([h for h, _ in chunk], [d for _, d in chunk])
        if self.stream is not None:
            self._copies_done.record(self.stream)
            self._order_compute(compute)

    @torch.inference_mode()
    def flush(self) -> None:
        """Complete every device->host copy into the host tier (blocking). Anyone reading
        `host_cache` directly (not through `copy`) calls this first."""
        self._finish_d2h(block=True)

    def staging_capacity(self) -> list[int]:
        """Blocks each pinned slot holds, least recently used first (tests, metrics)."""
        return [s.capacity for s in self.slots]

    # -- the compute stream's edge (R) ----------------------------------------------------
    def _order_compute(self, compute: torch.cuda.Stream | None) -> None:
        """The model's stream waits, on the device, for the side stream's gathers and
        scatters: every read or write of the pool it enqueues from now on comes after them."""
        assert compute is not None
        compute.wait_event(self._copies_done)

    # -- device -> host -------------------------------------------------------------------
    def _device_to_host(self, device_ids: list[int], host_ids: list[int]) -> None:
        """Side stream: gather into device staging [2L, n, *block], DMA into a pinned slot,
        event S. The scatter into the host tier is owed until S completes."""
        n = len(device_ids)
        slot = self._acquire(n)
        slot.index[:n].copy_(torch.tensor(device_ids, dtype=torch.long))
        with self._on_side():
            dev_index = self._device_buffer("d2h_index", n, torch.long)
            dev_index.copy_(slot.index[:n], non_blocking=True)
            staged = self._device_view("d2h", n)
            for i, t in enumerate(self._tensors(self.device_cache)):
                torch.index_select(t, 0, dev_index, out=staged[i])
            self._slot_view(slot, n).copy_(staged, non_blocking=True)
            slot.event.record(self.stream)
        slot.pending = True
        self.pending.append(_PendingD2H(slot, host_ids))

    def _finish_d2h(self, block: bool) -> None:
        """Scatter completed D2H transfers into the host tier, oldest first; with `block`,
        wait for all of them, else stop at the first one still in flight."""
        while self.pending:
            head = self.pending[0]
            if not block and not head.slot.event.query():
                return
            head.slot.event.synchronize()
            view = self._slot_view(head.slot, len(head.host_ids))
            host_index = torch.tensor(head.host_ids, dtype=torch.long)
            for i, t in enumerate(self._tensors(self.host_cache)):
                t.index_copy_(0, host_index, view[i])
            head.slot.pending = False
            self.pending.popleft()

    def _in_flight(self, host_ids: list[int]) -> bool:
        if not self.pending or not host_ids:
            return False
        wanted = set(host_ids)
        return any(not wanted.isdisjoint(p.host_ids) for p in self.pending)

    # -- host -> device -------------------------------------------------------------------
    def _host_to_device(self, host_ids: list[int], device_ids: list[int]) -> None:
        """CPU: gather into a pinned slot. Side stream: DMA to device staging, event H,
        scatter into the pool."""
        n = len(host_ids)
        slot = self._acquire(n)
        view = self._slot_view(slot, n)  # [2L, n, *block], pinned on CUDA
        src = torch.tensor(host_ids, dtype=torch.long)
        for i, t in enumerate(self._tensors(self.host_cache)):
            torch.index_select(t, 0, src, out=view[i])
        slot.index[:n].copy_(torch.tensor(device_ids, dtype=torch.long))
        with self._on_side():
            dev_index = self._device_buffer("h2d_index", n, torch.long)
            dev_index.copy_(slot.index[:n], non_blocking=True)
            staged = self._device_view("h2d", n)
            staged.copy_(view, non_blocking=True)
            slot.event.record(self.stream)  # the slot may be rewritten once this completes
            for i, t in enumerate(self._tensors(self.device_cache)):
                t.index_copy_(0, dev_index, staged[i])

    # -- staging --------------------------------------------------------------------------
    def _chunks(self, pairs: list[tuple[int, int]]) -> list[list[tuple[int, int]]]:
        c = self.chunk_blocks
        return [pairs[i:i + c] for i in range(0, len(pairs), c)]

    def _acquire(self, n: int) -> _Slot:
        """A pinned slot for n blocks whose previous DMAs are complete, grown if too small."""
        slot = next((s for s in self.slots if not s.pending and s.event.query()), None)
        if slot is None and len(self.slots) < self.max_slots:
            slot = self._new_slot(n)
        elif slot is None:  # every slot in flight: wait for the least recently used
            slot = self.slots[0]
            if slot.pending:
                self._finish_d2h(block=True)
            slot.event.synchronize()
        if slot in self.slots:
            self.slots.remove(slot)
        self.slots.append(slot)  # now the most recently used
        if slot.capacity < n:
            grown = self._new_slot(n)
            slot.data, slot.index, slot.capacity = grown.data, grown.index, grown.capacity
        return slot

    def _new_slot(self, n: int) -> _Slot:
        capacity = min(_next_pow2(n), self.chunk_blocks)
        data = torch.empty(capacity * self.num_tensors * self.block_elems, dtype=self.dtype,
                           pin_memory=self.cuda)
        index = torch.empty(capacity, dtype=torch.long, pin_memory=self.cuda)
        event = torch.cuda.Event() if self.cuda else _DoneEvent()
        return _Slot(data, index, event, capacity)

    def _slot_view(self, slot: _Slot, n: int) -> torch.Tensor:
        return slot.data[: n * self.num_tensors * self.block_elems].view(
            self.num_tensors, n, *self.block_shape)

    def _device_view(self, name: str, n: int) -> torch.Tensor:
        """[2L, n, *block] of a side-stream staging buffer."""
        per_block = self.num_tensors * self.block_elems
        flat = self._device_buffer(name, n * per_block, self.dtype,
                                   grow_to=min(_next_pow2(n), self.chunk_blocks) * per_block)
        return flat.view(self.num_tensors, n, *self.block_shape)

    def _device_buffer(self, name: str, numel: int, dtype: torch.dtype,
                       grow_to: int | None = None) -> torch.Tensor:
        """The first `numel` elements of a side-stream staging buffer, grown (to `grow_to`,
        else a power of two) as needed. Called on the side stream, so the caching allocator
        ties the buffer to that stream and a replaced one is reused only in its order."""
        buf = self._dev.get(name)
        if buf is None or buf.numel() < numel:
            size = max(numel, grow_to or _next_pow2(numel))
            buf = self._dev[name] = torch.empty(size, dtype=dtype, device=self.device)
        return buf[:numel]

    def _on_side(self) -> contextlib.AbstractContextManager:
        if self.stream is None:
            return contextlib.nullcontext()
        return torch.cuda.stream(self.stream)

    @staticmethod
    def _tensors(cache: KVCache) -> list[torch.Tensor]:
        return [t for kv in cache for t in kv]  # k0, v0, k1, v1, ...
