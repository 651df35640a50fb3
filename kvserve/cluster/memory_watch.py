"""Replica resident memory and replica count over a load test, for soak and autoscaling runs.

`MemoryWatch` samples every replica's published status row (`kvserve.cluster.replica_status`, which
carries the process's RSS) from a daemon thread while a load runs, and counts the replicas each
time; `memory_report` turns the samples into start / after-warm-up / end per replica and the
growth after warm-up, the number a soak test bounds (memory allocated while warming up, such as
allocator pools and compiled kernels, is expected; growth after it is a leak).

The RSS watched is the replica's less its KV pool's pages: a CPU pool is committed as its blocks
are first written (`kvserve.workers.model_executor.kv_cache`), so under a varied load, with prefix
caching keeping ended requests' blocks, the pool's share grows toward its configured size for
minutes; that growth is bounded and is not a leak (the status row carries it apart:
`kv_pool_bytes`).
"""

from __future__ import annotations

import csv
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvserve.cluster.replica_status import ReplicaStatus

MiB = 1024**2


@dataclass(frozen=True)
class MemorySample:
    t_s: float  # seconds since the watch started
    replica_id: str
    rss_bytes: int


@dataclass(frozen=True)
class ReplicaMemory:
    replica_id: str
    start_mib: float
    warm_mib: float  # the first sample at or after the warm-up
    end_mib: float
    growth_after_warmup_pct: float

    def to_dict(self) -> dict:
        return asdict(self)


class MemoryWatch:
    """Samples `read_rows()` (replica id -> RSS bytes) every `interval_s` until stopped."""

    def __init__(self, read_rows: Callable[[], dict[str, int]], interval_s: float = 2.0) -> None:
        self.read_rows, self.interval_s = read_rows, interval_s
        self.samples: list[MemorySample] = []
        # (t_s, replicas publishing a status row): how many replicas served, over the load
        # (autoscaling, replacements after a failure)
        self.replica_counts: list[tuple[float, int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvserve-memory-watch",
                                        daemon=True)
        self._start = 0.0
        self.started_at = 0.0  # wall clock (time.time()) at t_s = 0, to align other series

    def __enter__(self) -> MemoryWatch:
        self._start, self.started_at = time.monotonic(), time.time()
        self._sample()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self._sample()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._sample()

    def _sample(self) -> None:
        now = time.monotonic() - self._start
        rows = self.read_rows()
        for replica_id, rss in rows.items():
            if rss > 0:
                self.samples.append(MemorySample(now, replica_id, rss))
        self.replica_counts.append((now, len(rows)))


def memory_report(samples: list[MemorySample], warmup_s: float) -> list[ReplicaMemory]:
    """Per replica: RSS at the first sample, the first sample after `warmup_s`, and the last."""
    by_replica: dict[str, list[MemorySample]] = {}
    for sample in sorted(samples, key=lambda s: s.t_s):
        by_replica.setdefault(sample.replica_id, []).append(sample)
    report = []
    for replica_id, series in sorted(by_replica.items()):
        warm = next((s for s in series if s.t_s >= warmup_s), series[-1])
        end = series[-1]
        report.append(ReplicaMemory(
            replica_id, series[0].rss_bytes / MiB, warm.rss_bytes / MiB, end.rss_bytes / MiB,
            100.0 * (end.rss_bytes - warm.rss_bytes) / warm.rss_bytes))
    return report


def write_csv(samples: list[MemorySample], path: Path) -> Path:
    """The time series (t_s, replica_id, rss_mib), to see whether growth levels off."""
    with path.open("w", newline="") as f:
        out = csv.writer(f)
        out.writerow(["t_s", "replica_id", "rss_mib"])
        for s in samples:
            out.writerow([f"{s.t_s:.1f}", s.replica_id, f"{s.rss_bytes / MiB:.1f}"])
    return path


def plot_memory(samples: list[MemorySample], warmup_s: float, path: Path) -> Path:
    """Each replica's RSS over the load, the warm-up marked: does growth level off?"""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4))
    for replica_id in sorted({s.replica_id for s in samples}):
        series = [s for s in samples if s.replica_id == replica_id]
        ax.plot([s.t_s / 60 for s in series], [s.rss_bytes / MiB for s in series],
                label=f"replica {replica_id}")
    ax.axvline(warmup_s / 60, color="tab:gray", linestyle=":", label="end of warm-up")
    ax.set_xlabel("minutes into the load")
    ax.set_ylabel("resident memory (MiB)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def replica_rss_from_ray() -> dict[str, int]:
    """Replica id -> RSS less the KV pool's pages, from the status rows in Ray's GCS (needs a
    connected driver)."""
    from kvserve.cluster import replica_status

    return {rid: watched_bytes(row) for rid, row in replica_status.read_current().items()}


def watched_bytes(row: ReplicaStatus) -> int:
    """What a soak watches of a replica's memory: its RSS less its KV pool's written pages."""
    return row.rss_bytes - row.kv_pool_bytes
