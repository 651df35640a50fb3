"""The ranks of a tensor-parallel engine besides rank 0, as local worker processes, and rank
0's link to them (`Followers`).

Rank 0 lives in the engine's process and alone decides: it schedules, samples and owns the
block manager, the prefix cache and the host tier. Each other rank holds its slice of the model
and of every KV block, and runs exactly what rank 0 sends it, in order: a step's KV copies
(`KVCopyPlan`), a step's batch (`StepPlan`), or the stop. One message per call, over the
engine's step channel (`tp_step_channel`: the shared-memory ring, or broadcasts over the
group's gloo link); the model's all-reduces and the LM head's gather then run inside the
forward pass on every rank at once.

What fails how: a rank that raises or dies leaves the collective rank 0 is in within
milliseconds (its gloo sockets close; a shared-memory peer checks that its process is there),
so that collective fails (`RankFailed`), the step raises, and the engine above ends its
streams; a rank that hangs fails it after the group's timeout. When rank 0 goes, the others'
next read fails (gloo), or their idle check of rank 0's store does (shm), and they exit;
`Followers.close` (the engine's shutdown, its garbage collection, or the interpreter's exit)
stops them.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import sys
import time
import traceback
import types
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch

from kvserve.workers.parallel.group import RankFailed, TPGroup, join_store, open_store
from kvserve.workers.parallel.shm_ring import ShmRing

if TYPE_CHECKING:
    from kvserve.workers.config import EngineConfig
    from kvserve.workers.core.kv_events import KVCopyPlan
    from kvserve.workers.model_executor.loader import LoadedCheckpoint
    from kvserve.workers.model_executor.model_runner import StepPlan

STOP = None  # the message that ends a rank's loop
JOIN_TIMEOUT_S = 10.0


@dataclass
class RankArgs:
    """What a rank process is started with: everything it needs to build its part, picklable."""

    rank: int
    size: int
    port: int  # rank 0's store
    device: str
    config: EngineConfig
    hf_config: Any  # the checkpoint's (RoPE overrides applied)
    model: str | None  # load this checkpoint directory...
    tensors: dict[str, torch.Tensor] | None  # ...or take these (an in-memory checkpoint)
    threads: int  # torch threads; 0: the process's share of the cores (OMP_NUM_THREADS, as
    # Ray sets it for an actor's CPUs, else the node's cores over the ranks)


class RankProcess(Protocol):
    """A started rank: a local `multiprocessing.Process`, or a handle on a Ray actor
    (`kvserve.cluster.tp_ranks`): what rank 0 watches and stops."""

    name: str

    @property
    def pid(self) -> int | None: ...

    @property
    def exitcode(self) -> int | None: ...

    def is_alive(self) -> bool: ...

    def join(self, timeout: float | None = None) -> None: ...

    def terminate(self) -> None: ...

    def kill(self) -> None: ...


# starts one rank running `rank_main(args)` and returns it (`launch_local` by default)
RankLauncher = Callable[[RankArgs], RankProcess]


def launch_local(args: RankArgs) -> RankProcess:
    """A rank as a local process, forked from multiprocessing's fork server: a process that
    imported torch and the engine once, has no threads and no CUDA context, so each rank
    starts in a fraction of a second instead of importing torch again (~2 s) as a spawned
    one would; and unlike a fork of rank 0 it inherits none of rank 0's threads or state."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["kvserve.workers.builder"])
    process = context.Process(target=rank_main, args=(args,), daemon=True,
                              name=f"kvserve-tp-rank-{args.rank}")
    with _main_not_rerun():
        process.start()
    return process


class GlooChannel:
    """Step messages as broadcasts over the group's CPU (gloo) link."""

    def __init__(self, group: TPGroup) -> None:
        self.group = group

    def send(self, obj: object) -> None:
        self.group.broadcast_object(obj)

    def recv(self) -> object:
        return self.group.broadcast_object(idle=True)

    def close(self) -> None:
        pass


Channel = GlooChannel | ShmRing


class Followers:
    """Rank 0's handle on ranks 1..N-1: the group, the processes, and the messages
    (`ModelRunner`'s StepSender), sent over `channel` (tp_step_channel)."""

    def __init__(self, group: TPGroup, processes: list[RankProcess], channel: Channel) -> None:
        self.group = group
        self.processes = processes
        self.channel = channel
        self._finalizer = weakref.finalize(self, _stop, group, processes, channel)

    def _send(self, message: object) -> None:
        start = time.perf_counter()
        self.channel.send(message)
        self.group.stats.add("step_message", time.perf_counter() - start, 0)

    def send_copy(self, plan: KVCopyPlan) -> None:
        self._send(("copy", plan))

    def copies_done(self) -> None:
        """Returns once every rank has done the copies just sent."""
        if not self.group.all_ok(True):
            raise RankFailed("a tensor-parallel rank could not copy KV blocks")

    def send_step(self, plan: StepPlan) -> None:
        self._send(("step", plan, time.monotonic()))

    def latency(self) -> dict[str, float]:
        """From rank 0's send of a step's plan to each rank's receipt of it, as the ranks
        measured it since the last call: mean and max seconds, and the steps counted (a
        collective: every rank answers, then starts counting again)."""
        self._send(("latency",))
        sums = self.group.gather_last_dim(torch.zeros(3, dtype=torch.float64), cpu=True)
        per_rank = sums.view(-1, 3)[1:]  # rank 0 sends; it receives nothing
        steps = float(per_rank[:, 2].min())
        return {"mean_s": float(per_rank[:, 0].sum() / per_rank[:, 2].sum().clamp(min=1)),
                "max_s": float(per_rank[:, 1].max()), "steps": steps}

    def alive(self) -> bool:
        return all(p.is_alive() for p in self.processes)

    def pids(self) -> list[int]:
        return [p.pid for p in self.processes if p.pid is not None]

    def close(self) -> None:
        """Stop the ranks (a stop message, then terminate what did not end). Idempotent."""
        self._finalizer()


def start_followers(config: EngineConfig, ckpt: LoadedCheckpoint, device: torch.device,
                    launch: RankLauncher | None = None) -> Followers:
    """Start ranks 1..tensor_parallel_size-1 (`launch`: local processes by default) and form
    the group with them. A checkpoint read from a directory is read by each rank there (memory
    mapped: each rank reads and keeps its slice); an in-memory one (tests' tiny random
    checkpoints) has its tensors shared with them."""
    size = config.tensor_parallel_size
    store = open_store(size)
    threads = config.num_threads or 0
    from_files = any(Path(ckpt.path).glob("*.safetensors"))
    processes: list[RankProcess] = []
    try:
        for rank in range(1, size):
            args = RankArgs(rank, size, store.port, str(device), config, ckpt.config,
                            str(ckpt.path) if from_files else None,
                            None if from_files else ckpt.tensors, threads)
            processes.append((launch or launch_local)(args))
        _wait_joined(store, processes, "joined")
        group = TPGroup(store, 0, size, device)
        if config.tp_step_channel == "shm":
            channel: Channel = ShmRing.create(group, group.timeout.total_seconds())
            store.set("ring", channel.name)
            try:
                _wait_joined(store, processes, "attached")
            finally:
                channel.unlink()  # mapped by every rank (or failed): the name can go
        else:
            channel = GlooChannel(group)
    except BaseException:
        _terminate(processes)
        raise
    return Followers(group, processes, channel)


@contextlib.contextmanager
def _main_not_rerun() -> Iterator[None]:
    """Local ranks run `rank_main` alone: a spawned or fork-server child imports its parent's
    main script again (multiprocessing's `__main__` fix-up), which in a script without an
    `if __name__ == "__main__"` guard would build the engine again, and its ranks, without end.
    The children are started while `__main__` looks like a module without a file."""
    main = sys.modules["__main__"]
    sys.modules["__main__"] = types.ModuleType("__main__")
    try:
        yield
    finally:
        sys.modules["__main__"] = main


def _wait_joined(store, processes: list[RankProcess], what: str) -> None:
    """Wait until every rank has set `what/<rank>` in the store (reached it, mapped the ring),
    or say which one died first (rather than wait the rendezvous's whole timeout for a rank
    that is gone)."""
    keys = [f"{what}/{rank}" for rank in range(1, len(processes) + 1)]
    deadline = time.monotonic() + JOIN_TIMEOUT_S * 6
    while not store.check(keys):
        for p in processes:
            if not p.is_alive():
                raise RankFailed(f"tensor-parallel {p.name} ended at its start (exit code "
                                 f"{p.exitcode}); its error is above")
        if time.monotonic() > deadline:
            raise RankFailed("tensor-parallel ranks did not start within "
                             f"{JOIN_TIMEOUT_S * 6:.0f} s")
        time.sleep(0.02)


def rank_main(args: RankArgs) -> None:
    """A follower rank's process: build its part, then run what rank 0 sends until the stop."""
    if args.threads or "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(args.threads or max(1, (os.cpu_count() or 1) // args.size))
    device = torch.device(args.device)
    if device.type == "cuda":  # a local rank sees every GPU, a Ray actor its own one
        device = torch.device("cuda", args.rank if torch.cuda.device_count() > 1 else 0)
        torch.cuda.set_device(device)
    try:
        store = join_store(args.size, args.port)
        store.set(f"joined/{args.rank}", "1")
        group = TPGroup(store, args.rank, args.size, device)
        if args.config.tp_step_channel == "shm":
            channel: Channel = ShmRing.attach(store.get("ring").decode(), group,
                                              group.timeout.total_seconds())
            store.set(f"attached/{args.rank}", "1")
        else:
            channel = GlooChannel(group)
        runner = _build(args, group, device)
        serve(runner, group, channel)
    except RankFailed:
        sys.exit(1)  # rank 0 went away or failed: it says why
    except BaseException:
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)  # closes this rank's sockets: rank 0's collective fails at once


def _build(args: RankArgs, group: TPGroup, device: torch.device):
    from kvserve.workers.builder import build_rank, cpu_kernels_for, resolve_dtype
    from kvserve.workers.model_executor.loader import LoadedCheckpoint, load_checkpoint

    dtype = resolve_dtype(args.config.dtype, device)
    if args.tensors is not None:
        ckpt = LoadedCheckpoint(args.config.model or "", args.hf_config, None, args.tensors)
    else:
        loaded = load_checkpoint(args.model)
        ckpt = LoadedCheckpoint(loaded.path, args.hf_config, None, loaded.tensors)
    return build_rank(args.config, ckpt, device, dtype, cpu_kernels_for(device, dtype),
                      group).runner


def serve(runner, group: TPGroup, channel: Channel) -> None:
    """Run rank 0's messages in order until the stop."""
    latency = torch.zeros(3, dtype=torch.float64)  # sum and max of the plans' latency, steps
    while True:
        message = channel.recv()
        if message is STOP:
            channel.close()
            return
        kind, *payload = message
        if kind == "step":
            plan, sent = payload
            waited = time.monotonic() - sent
            latency += torch.tensor([waited, 0.0, 1.0], dtype=torch.float64)
            latency[1] = max(float(latency[1]), waited)
            runner.forward(runner.inputs(plan))
        elif kind == "copy":
            runner.copy(payload[0])
            group.all_ok(True)
        elif kind == "latency":
            group.gather_last_dim(latency, cpu=True)
            latency.zero_()
        else:
            raise ValueError(f"unknown message {kind!r} from rank 0")


def _stop(group: TPGroup, processes: list[RankProcess], channel: Channel) -> None:
    if all(p.is_alive() for p in processes):
        with contextlib.suppress(RankFailed):
            channel.send(STOP)
    _terminate(processes)
    channel.close()


def _terminate(processes: list[RankProcess]) -> None:
    for p in processes:
        p.join(JOIN_TIMEOUT_S if p.is_alive() else 0)
        if p.is_alive():
            p.terminate()
            p.join(JOIN_TIMEOUT_S)
        if p.is_alive():
            p.kill()
            p.join()

