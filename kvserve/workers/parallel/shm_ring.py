"""Rank 0's step messages to the other ranks of its node through shared memory (vLLM's
`MessageQueue` over its `ShmRingBuffer`): a ring of slots one writer fills and every reader
reads, with no system call on the way.

Why: over gloo each step's plan costs two broadcasts through the loopback's TCP stack (a length,
then the bytes), ~0.3-0.5 ms a step on a 2-core VM; a step that decodes a small batch on a GPU
takes a few ms, so that is a tenth of it. Every rank of an engine is on one node (local
processes, or a replica's STRICT_PACK placement group), so they can share pages instead.

Layout: a header of one written-sequence counter and one read-sequence counter per reader, then
SLOTS slots of [length: 8 bytes][payload]. The writer waits until every reader has read the
message a slot held, writes the payload, then its length, then bumps the sequence; a reader
waits for the sequence to pass its own, copies the payload out and bumps its counter. Each
counter has one writer. x86's stores reach other cores in program order, so a reader that sees
a sequence sees the payload before it; other CPUs would need fences here.

A reader waits as `backoff.Backoff` says: on the core for SPIN_S (not at all with fewer cores
than ranks), then off it, polling every ~50 us for the next step's plan, and once idle with a
growing pause up to IDLE_SLEEP_S. A message larger than a slot goes
over the gloo group instead (a marker in the ring says so). The segment is unlinked as soon as
every reader has mapped it, so nothing is left in /dev/shm whatever ends the processes.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import pickle
import struct
import tempfile

from kvserve.workers.parallel.backoff import Backoff
from kvserve.workers.parallel.group import RankFailed, TPGroup

SLOTS = 4
SLOT_BYTES = 1 << 20  # a step plan of 4096 tokens pickles to ~100 KB
SPIN_S = 200e-6
IDLE_SLEEP_S = 0.002
_U64 = struct.Struct("<Q")
_I64 = struct.Struct("<q")
OVER_GLOO = -1  # the slot's length when the message went over the gloo group


class ShmRing:
    """One engine's ring. Rank 0 creates it (`create`), the others attach by name (`attach`);
    rank 0 `send`s, the others `recv` in the same order."""

    def __init__(self, path: str, readers: int, rank: int, group: TPGroup,
                 timeout_s: float) -> None:
        self.path, self.readers, self.rank, self.group = path, readers, rank, group
        self.timeout_s = timeout_s
        self.header = 8 * (1 + readers)
        size = self.header + SLOTS * (8 + SLOT_BYTES)
        fd = os.open(path, os.O_RDWR | (os.O_CREAT | os.O_EXCL if rank == 0 else 0), 0o600)
        try:
            if rank == 0:
                os.ftruncate(fd, size)  # zero pages: every counter starts at 0
            self.memory = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        self.buf = memoryview(self.memory)
        self.seq = 0  # messages sent (rank 0) or read (the others)
        # spin (briefly) only where every rank can have a core
        self.spin_s = SPIN_S if len(os.sched_getaffinity(0)) >= group.size else 0.0

    @classmethod
    def create(cls, group: TPGroup, timeout_s: float) -> ShmRing:
        """Rank 0's ring, a file in /dev/shm (a tmpfs: memory, not disk) until `unlink`.
        Not multiprocessing's SharedMemory: its resource tracker, which local ranks share
        with rank 0 and Ray actors do not, would unlink the segment at a reader's exit."""
        root = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
        path = os.path.join(root, f"kvserve-tp-{os.getpid()}-{id(group):x}")
        return cls(path, group.size - 1, 0, group, timeout_s)

    @classmethod
    def attach(cls, name: str, group: TPGroup, timeout_s: float) -> ShmRing:
        return cls(name, group.size - 1, group.rank, group, timeout_s)

    @property
    def name(self) -> str:
        return self.path

    def unlink(self) -> None:
        """Rank 0, once every reader has mapped it: the name goes, the pages stay mapped."""
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)

    # -- rank 0 ------------------------------------------------------------------------------
    def send(self, obj: object) -> None:
        data = pickle.dumps(obj, pickle.HIGHEST_PROTOCOL)
        slot = self._slot(self.seq)
        self._wait_readers(self.seq - SLOTS + 1)  # they have read what this slot held
        if len(data) > SLOT_BYTES:
            _I64.pack_into(self.buf, slot, OVER_GLOO)
            self._publish()
            self.group.broadcast_object(obj)
            return
        self.buf[slot + 8:slot + 8 + len(data)] = data
        _I64.pack_into(self.buf, slot, len(data))
        self._publish()

    def _publish(self) -> None:
        self.seq += 1
        _U64.pack_into(self.buf, 0, self.seq)

    def _wait_readers(self, seq: int) -> None:
        if seq <= 0:
            return
        backoff = Backoff()
        offsets = [8 * (1 + r) for r in range(self.readers)]
        while any(_U64.unpack_from(self.buf, o)[0] < seq for o in offsets):
            if backoff.pause() > self.timeout_s:
                raise RankFailed(f"a tensor-parallel rank did not read its step messages "
                                 f"within {self.timeout_s:.0f} s")

    # -- ranks 1..N-1 ------------------------------------------------------------------------
    def recv(self) -> object:
        """The next message; waits as long as rank 0 sends none, and raises RankFailed once
        rank 0 is gone (its store no longer answers)."""
        backoff = Backoff(longest_s=IDLE_SLEEP_S, spin_s=self.spin_s)
        checked = 0.0
        while _U64.unpack_from(self.buf, 0)[0] <= self.seq:
            waited = backoff.pause()
            if waited - checked > 1.0:  # idle: is rank 0 still there?
                checked = waited
                self.group.check_first_alive()
        slot = self._slot(self.seq)
        length = _I64.unpack_from(self.buf, slot)[0]
        if length == OVER_GLOO:
            self._read()
            return self.group.broadcast_object()
        data = bytes(self.buf[slot + 8:slot + 8 + length])
        self._read()
        return pickle.loads(data)

    def _read(self) -> None:
        self.seq += 1
        _U64.pack_into(self.buf, 8 * self.rank, self.seq)

    def _slot(self, seq: int) -> int:
        return self.header + (seq % SLOTS) * (8 + SLOT_BYTES)

    def close(self) -> None:
        self.buf.release()
        with contextlib.suppress(BufferError):  # a view still alive: it goes with the process
            self.memory.close()
