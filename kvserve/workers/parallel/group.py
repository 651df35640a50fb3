"""The one module that owns the collectives of a tensor-parallel engine (vLLM's
`parallel_state`): the group's creation, its timeouts, and every call the model and the ranks
make on it.

Why a group object and not torch.distributed's default group: a process may hold several
engines (a test's tp 1 and tp 2 twins, a benchmark's), each with ranks of its own, so each
engine's group is built from its own store (`TCPStore` on a port the OS picks) rather than
from `init_process_group`'s one per process.

Two groups under one object: `cpu` (gloo) carries the step plans and start-up agreements
on every device; `device` carries the model's all-reduces and gathers: NCCL on CUDA, the same
gloo group on a CPU, where the all-reduces go through shared memory instead
(`shm_all_reduce`). On a CPU, gloo binds to the loopback interface unless GLOO_SOCKET_IFNAME
names another (every rank of an engine runs on one node: a replica's placement group packs
them).
"""

from __future__ import annotations

import datetime
import os
import pickle
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from kvserve.workers.parallel.shm_all_reduce import ShmAllReduce

LOOPBACK = "127.0.0.1"
# the ranks' collectives end with an error after this long rather than NCCL's 30 minutes: a
# rank that stopped answering ends the engine's streams, not hangs them
DEFAULT_TIMEOUT_S = 60.0
# a rank waiting for its next step may wait as long as the engine is idle
IDLE_TIMEOUT = datetime.timedelta(days=365)


class RankFailed(RuntimeError):
    """A collective failed: a rank died, raised, or stopped answering. The engine cannot go on
    (a step half done on some ranks leaves their KV unlike the others'), so it ends."""


@dataclass
class CollectiveStats:
    """Seconds and bytes of each kind of collective since the start (or the last reset):
    what `kvserve bench throughput -tp N` divides by its steps."""

    calls: dict[str, int] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)
    bytes: dict[str, int] = field(default_factory=dict)

    def add(self, kind: str, seconds: float, nbytes: int) -> None:
        self.calls[kind] = self.calls.get(kind, 0) + 1
        self.seconds[kind] = self.seconds.get(kind, 0.0) + seconds
        self.bytes[kind] = self.bytes.get(kind, 0) + nbytes

    def reset(self) -> None:
        self.calls.clear()
        self.seconds.clear()
        self.bytes.clear()


def open_store(size: int, port: int = 0, host: str = LOOPBACK,
               timeout_s: float = DEFAULT_TIMEOUT_S) -> dist.TCPStore:
    """Rank 0's rendezvous store, on `port` (0: one the OS picks, read back from `.port`, so two
    engines on one node never collide). The other ranks join it with `join_store`."""
    return dist.TCPStore(host, port, size, True, timeout=datetime.timedelta(seconds=timeout_s),
                         wait_for_workers=False)


def join_store(size: int, port: int, host: str = LOOPBACK,
               timeout_s: float = DEFAULT_TIMEOUT_S) -> dist.TCPStore:
    return dist.TCPStore(host, port, size, False, timeout=datetime.timedelta(seconds=timeout_s))


class TPGroup:
    """One engine's ranks. Every method is a collective: each rank calls it, in the same order.

    rank: this process's rank (0 decides); size: tensor_parallel_size."""

    def __init__(self, store: dist.Store, rank: int, size: int, device: torch.device,
                 timeout_s: float = DEFAULT_TIMEOUT_S, shm_all_reduce: bool = True) -> None:
        """`shm_all_reduce`: on a CPU, all-reduce through shared memory (False: gloo's, for
        the collectives benchmark)."""
        self.rank, self.size, self.device = rank, size, device
        self.store = store  # rank 0's serves the others' rendezvous: kept as long as the group
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self.stats = CollectiveStats()
        self.cpu = _gloo(dist.PrefixStore("cpu/", store), rank, size, self.timeout)
        self.shm: ShmAllReduce | None = None  # the CPU ranks' all-reduce (shm_all_reduce.py)
        if (shm_all_reduce and device.type == "cpu" and os.path.isdir("/dev/shm")
                and os.path.isdir("/proc")):
            self.shm = _open_shm_all_reduce(store, rank, size, timeout_s)
        if device.type == "cuda":
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = self.timeout
            self.device_group = dist.ProcessGroupNCCL(dist.PrefixStore("nccl/", store), rank,
                                                      size, options)
        else:
            self.device_group = self.cpu
        self.backend = "nccl" if device.type == "cuda" else "gloo"

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    # -- the model's collectives (per layer) ----------------------------------------------
    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """x summed over the ranks, in place (x: contiguous). o_proj's and down_proj's partial
        sums, the embedding's slices."""
        start = time.perf_counter()
        if self.shm is not None and self.shm.fits(x):
            self.shm(x)
        else:
            self._wait(self.device_group.allreduce([x]), "all_reduce")
        self.stats.add("all_reduce", time.perf_counter() - start, x.numel() * x.element_size())
        return x

    def gather_last_dim(self, x: torch.Tensor, cpu: bool = False) -> torch.Tensor | None:
        """Rank 0: every rank's x joined along the last dim, in rank order (the LM head's
        vocabulary slices -> whole logits); the other ranks: None. `cpu`: over the CPU group
        (host tensors, e.g. the ranks' own measurements)."""
        start = time.perf_counter()
        x = x.contiguous()
        outputs = [[torch.empty_like(x) for _ in range(self.size)]] if self.is_first else []
        options = dist.GatherOptions()
        options.rootRank = 0
        group = self.cpu if cpu else self.device_group
        self._wait(group.gather(outputs, [x], options), "gather")
        if not cpu:
            self.stats.add("gather", time.perf_counter() - start, x.numel() * x.element_size())
        return torch.cat(outputs[0], dim=-1) if self.is_first else None

    # -- the engine's messages (per step, on the CPU group) -------------------------------
    def broadcast_object(self, obj: object = None, idle: bool = False) -> object:
        """Rank 0's `obj` on every rank (pickled: a length, then the bytes). `idle`: a rank
        waits for it without a timeout (the next step comes when a request does)."""
        start = time.perf_counter()
        options = dist.BroadcastOptions()
        options.rootRank = 0
        options.timeout = IDLE_TIMEOUT if idle else self.timeout
        if self.is_first:
            payload = torch.frombuffer(bytearray(pickle.dumps(obj, pickle.HIGHEST_PROTOCOL)),
                                       dtype=torch.uint8)
            length = torch.tensor([payload.numel()], dtype=torch.long)
        else:
            length = torch.zeros(1, dtype=torch.long)
        self._wait(self.cpu.broadcast([length], options), "broadcast")
        if not self.is_first:
            payload = torch.empty(int(length), dtype=torch.uint8)
        options.timeout = self.timeout
        self._wait(self.cpu.broadcast([payload], options), "broadcast")
        self.stats.add("broadcast", time.perf_counter() - start, payload.numel() + 8)
        return obj if self.is_first else pickle.loads(payload.numpy().tobytes())

    def min_int(self, value: int) -> int:
        """The smallest of the ranks' values (the KV blocks every rank can hold)."""
        x = torch.tensor([value], dtype=torch.long)
        options = dist.AllreduceOptions()
        options.reduceOp = dist.ReduceOp.MIN
        self._wait(self.cpu.allreduce([x], options), "min")
        return int(x)

    def all_ok(self, ok: bool) -> bool:
        """Whether every rank says ok (a step's KV copies done everywhere)."""
        return self.min_int(int(ok)) == 1

    def check_first_alive(self) -> None:
        """Raise RankFailed if rank 0 is gone (its store no longer answers): a rank waiting
        for messages outside the group (`ShmRing`) asks now and then."""
        try:
            self.store.check(["joined/1"])
        except Exception as exc:  # noqa: BLE001 - the store's client raises its own kinds
            raise RankFailed(f"tensor-parallel rank {self.rank}/{self.size}: rank 0 is gone "
                             f"({exc})") from exc

    def _wait(self, work: dist.Work, what: str) -> None:
        try:
            work.wait()
        except Exception as exc:  # gloo and NCCL raise RuntimeError and DistBackendError
            raise RankFailed(f"tensor-parallel rank {self.rank}/{self.size}: {what} failed: "
                             f"{exc}") from exc


def _open_shm_all_reduce(store: dist.Store, rank: int, size: int,
                         timeout_s: float) -> ShmAllReduce:
    """Rank 0 creates the segment and names it in the store; once every rank has mapped it
    (and published its pid there), the name goes."""
    if rank == 0:
        path = f"/dev/shm/kvserve-tp-all-reduce-{os.getpid()}-{id(store):x}"
        shm = ShmAllReduce(path, 0, size, True, timeout_s)
        store.set("all_reduce", path)
        try:
            store.wait([f"all_reduce/{r}" for r in range(1, size)])
        finally:
            shm.unlink()
        return shm
    shm = ShmAllReduce(store.get("all_reduce").decode(), rank, size, False, timeout_s)
    store.set(f"all_reduce/{rank}", "1")
    return shm


def _gloo(store: dist.Store, rank: int, size: int,
          timeout: datetime.timedelta) -> dist.ProcessGroupGloo:
    options = dist.ProcessGroupGloo._Options()
    options._timeout = timeout
    interface = os.environ.get("GLOO_SOCKET_IFNAME")
    device = (dist.ProcessGroupGloo.create_device(interface=interface.split(",")[0])
              if interface else dist.ProcessGroupGloo.create_device(hostname=LOOPBACK))
    options._devices = [device]
    return dist.ProcessGroupGloo(store, rank, size, options)
