"""`python -m kvserve.bench.collectives`: the CPU ranks' collectives alone, between processes
on this machine: the all-reduce through shared memory against gloo's, and a step plan's trip
through the shared-memory ring against gloo's broadcast, at the sizes a decode step moves.

Each figure is the median of `--iters` calls after a warm-up, measured on rank 0 (all-reduce)
or from rank 0's send to rank 1's receipt (plans; CLOCK_MONOTONIC is one clock for every
process of a machine). Quote it with `kvserve bench machine`'s line: on a shared VM it moves.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import socket
import statistics
import sys
import time
from typing import Any

import torch

from kvserve.workers.parallel.group import TPGroup, join_store, open_store
from kvserve.workers.parallel.ranks import GlooChannel
from kvserve.workers.parallel.shm_ring import ShmRing

ALL_REDUCE_ROWS = (1, 32, 256)  # a decode step's tokens; hidden 576 (SmolLM2), fp32
HIDDEN = 576
PLAN_ROWS = (1, 32, 256)


def decode_plan(rows: int, blocks: int = 12) -> tuple:
    """What a decode step's plan (`StepPlan`) for `rows` requests, each with its own block
    table, holds, as plain lists: token ids, positions, slots, (table, length) per decode,
    prefills, logits rows and RoPE spans."""
    return (list(range(rows)), [180] * rows, list(range(rows)),
            [(list(range(r, r + blocks)), 180) for r in range(rows)], [], list(range(rows)),
            [(179, 1, 128) for _ in range(rows)])


def _rank(rank: int, size: int, port: int, iters: int, results: Any) -> None:
    torch.set_num_threads(1)
    store = open_store(size, port) if rank == 0 else join_store(size, port)
    out: dict[str, Any] = {"all_reduce_us": {}, "plan_us": {}}
    for kind in ("shm", "gloo"):
        group = TPGroup(store if kind == "shm" else _prefixed(store, kind), rank, size,
                        torch.device("cpu"), shm_all_reduce=kind == "shm")
        for rows in ALL_REDUCE_ROWS:
            x = torch.ones(rows, HIDDEN)
            times = []
            for i in range(iters + 20):
                start = time.perf_counter()
                group.all_reduce(x)
                if i >= 20:
                    times.append(time.perf_counter() - start)
            out["all_reduce_us"].setdefault(kind, {})[rows] = 1e6 * statistics.median(times)
        if kind == "shm":
            if rank == 0:
                channel: Any = ShmRing.create(group, 60)
                store.set("bench-ring", channel.name)
            else:
                channel = ShmRing.attach(store.get("bench-ring").decode(), group, 60)
            group.min_int(0)  # every rank has mapped it: the name can go
            if rank == 0:
                channel.unlink()
        else:
            channel = GlooChannel(group)
        for rows in PLAN_ROWS:
            plan = decode_plan(rows)
            waits = []
            for _ in range(iters):
                if rank == 0:
                    time.sleep(0.002)  # a step's gap: the reader waits for it, as between steps
                    channel.send(("step", plan, time.monotonic()))
                else:
                    _, _, sent = channel.recv()
                    waits.append(time.monotonic() - sent)
            if rank == 1:
                out["plan_us"].setdefault(kind, {})[rows] = 1e6 * statistics.median(waits)
            group.min_int(0)
    results.put((rank, out))
    time.sleep(0.5)


def _prefixed(store: Any, prefix: str) -> Any:
    import torch.distributed as dist

    return dist.PrefixStore(prefix + "/", store)


def run(size: int = 2, iters: int = 300) -> dict[str, Any]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    procs = [context.Process(target=_rank, args=(r, size, port, iters, results))
             for r in range(size)]
    for p in procs:
        p.start()
    got = dict(results.get(timeout=600) for _ in range(size))
    for p in procs:
        p.join(30)
    from kvserve.workers.model_executor.cpu_kernels import cpu_summary

    return {"ranks": size, "iters": iters, "cpu": cpu_summary(), "hidden": HIDDEN,
            "all_reduce_us": got[0]["all_reduce_us"], "plan_us": got[1]["plan_us"]}


def summarize(r: dict[str, Any]) -> str:
    lines = [f"{r['ranks']} ranks on {r['cpu']}, medians of {r['iters']} calls"]
    for rows in ALL_REDUCE_ROWS:
        shm, gloo = r["all_reduce_us"]["shm"][rows], r["all_reduce_us"]["gloo"][rows]
        kb = rows * r["hidden"] * 4 / 1e3
        lines.append(f"  all-reduce [{rows} x {r['hidden']}] fp32 ({kb:.0f} KB): shared memory "
                     f"{shm:8.1f} us, gloo {gloo:8.1f} us: {gloo / shm:.1f}x")
    for rows in PLAN_ROWS:
        shm, gloo = r["plan_us"]["shm"][rows], r["plan_us"]["gloo"][rows]
        lines.append(f"  step plan of {rows} decodes, send to receipt: shm ring {shm:8.1f} us, "
                     f"gloo {gloo:8.1f} us: {gloo / shm:.1f}x")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvserve.bench.collectives",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=2, help="processes (default 2)")
    parser.add_argument("--iters", type=int, default=300, help="calls per figure (default 300)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)
    report = run(args.ranks, args.iters)
    print(json.dumps(report, indent=2) if args.json else summarize(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
