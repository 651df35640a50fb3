"""The CPU ranks' all-reduce through shared memory, as vLLM's CPU backend has one: gloo's takes
0.4-1.1 ms for a 2 KB tensor on the 2-core VMs here (a round trip through the loopback's TCP and
two thread wake-ups per call), and a decode step makes two per layer: 25-65 ms a step for a
30-layer model, which no CPU step survives (`python -m kvserve.bench.collectives` measures
both).

Each rank copies its tensor into its own slot, publishes the call's number in its counter,
waits until every rank's counter has it, then sums the slots in rank order into its tensor, so
every rank computes the same sum in the same order and gets the same bits. The slots are
double-buffered by call number: a rank one call ahead writes the other buffer, and it cannot get
two ahead, since its next call waits for every rank to publish. A tensor larger than a slot goes
over gloo.

Waiting spins briefly, then polls off the core (`backoff.Backoff`) and, every POLL_S, checks
that the other ranks' processes are still there, so a dead rank fails the collective within
milliseconds, as a closed gloo socket would, and a hung one after the group's timeout.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import struct

import torch

from kvserve.workers.parallel.backoff import Backoff

SLOT_BYTES = 8 << 20  # [tokens, hidden] fp32: 512 tokens x 4096 wide
POLL_S = 0.05
_U64 = struct.Struct("<Q")
_HEADER = 64  # per rank: its call counter (8 bytes) and its pid (8), in a cache line of its own


class ShmAllReduce:
    def __init__(self, path: str, rank: int, size: int, create: bool, timeout_s: float) -> None:
        self.path, self.rank, self.size, self.timeout_s = path, rank, size, timeout_s
        total = size * _HEADER + 2 * size * SLOT_BYTES
        fd = os.open(path, os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0), 0o600)
        try:
            if create:
                os.ftruncate(fd, total)
            self.memory = mmap.mmap(fd, total)
        finally:
            os.close(fd)
        self.buf = memoryview(self.memory)
        self.bytes = torch.frombuffer(self.memory, dtype=torch.uint8)
        self.calls = 0
        _U64.pack_into(self.buf, rank * _HEADER + 8, os.getpid())

    def unlink(self) -> None:
        if os.path.exists(self.path):
            os.unlink(self.path)

    def fits(self, x: torch.Tensor) -> bool:
        return x.device.type == "cpu" and x.is_contiguous() and x.numel() * x.element_size() \
            <= SLOT_BYTES

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x summed over the ranks, in place."""
        self.calls += 1
        nbytes = x.numel() * x.element_size()
        slots = [self._slot(r, nbytes, x.dtype).view(x.shape) for r in range(self.size)]
        slots[self.rank].copy_(x)
        _U64.pack_into(self.buf, self.rank * _HEADER, self.calls)
        self._wait_all(self.calls)
        torch.add(slots[0], slots[1], out=x)
        for slot in slots[2:]:  # in rank order on every rank: the same bits everywhere
            x.add_(slot)
        return x

    def _slot(self, rank: int, nbytes: int, dtype: torch.dtype) -> torch.Tensor:
        start = self.size * _HEADER + ((self.calls % 2) * self.size + rank) * SLOT_BYTES
        return self.bytes[start:start + nbytes].view(dtype)

    def _wait_all(self, call: int) -> None:
        from kvserve.workers.parallel.group import RankFailed  # (group imports this module)

        backoff = Backoff()
        checked = 0.0
        for rank in range(self.size):
            while _U64.unpack_from(self.buf, rank * _HEADER)[0] < call:
                waited = backoff.pause()
                if waited - checked > POLL_S:
                    checked = waited
                    pid = _U64.unpack_from(self.buf, rank * _HEADER + 8)[0]
                    if not _running(pid):
                        raise RankFailed(f"tensor-parallel rank {rank}/{self.size} (pid {pid}) "
                                         "is gone")
                    if waited > self.timeout_s:
                        raise RankFailed(f"tensor-parallel rank {rank}/{self.size} did not "
                                         f"reach the all-reduce within {self.timeout_s:.0f} s")

    def close(self) -> None:
        del self.bytes
        self.buf.release()
        with contextlib.suppress(BufferError):  # a view still alive: it goes with the process
            self.memory.close()


def _running(pid: int) -> bool:
    """The process exists and has not exited (a zombie: exited, not yet reaped)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False
