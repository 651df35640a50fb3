"""Result files in lm-evaluation-harness's shapes, and the resumable per-sample log.

`results.json`: {"results": {task: {"metric,filter": value, "metric_stderr,filter": value}},
"config", "versions", "n-samples", "date", "git_hash"}. `samples.jsonl`: one JSON object per
finished sample, appended as it finishes; a rerun with the same output directory reads it and
skips every sample already there (keyed by `key`).
"""

from __future__ import annotations

import csv
import json
import subprocess
import threading
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

FILTER = "none"  # lm-eval's filter name for unfiltered responses


def metric_entry(metrics: dict[str, float], stderrs: dict[str, float]) -> dict[str, float]:
    """{"acc": 0.5}, {"acc": 0.1} -> {"acc,none": 0.5, "acc_stderr,none": 0.1}."""
    out: dict[str, float] = {}
    for name, value in metrics.items():
        out[f"{name},{FILTER}"] = value
        if name in stderrs:
            out[f"{name}_stderr,{FILTER}"] = stderrs[name]
    return out


def write_results(out_dir: Path, results: dict[str, dict[str, float]], config: dict[str, Any],
                  versions: dict[str, Any], n_samples: dict[str, dict[str, int]]) -> Path:
    payload = {"results": results, "config": config, "versions": versions,
               "n-samples": n_samples, "date": time.time(), "git_hash": git_hash()}
    path = out_dir / "results.json"
    path.write_text(json.dumps(payload, indent=2) + "\n")
    return path


def write_csv(path: Path, rows: list[dict[str, Any]]) -> Path:
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]) if rows else [])
        writer.writeheader()
        writer.writerows(rows)
    return path


def git_hash() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                             text=True, timeout=5, cwd=Path(__file__).parent)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


class SampleLog:
    """samples.jsonl: append-only, thread-safe, read back for resuming."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._lock = threading.Lock()
        self.records: dict[str, dict[str, Any]] = {}
        if path.exists():
            for line in path.read_text().splitlines():
                if line.strip():
                    record = json.loads(line)
                    self.records[record["key"]] = record

    def has(self, key: str) -> bool:
        return key in self.records

    def append(self, record: dict[str, Any]) -> None:
        with self._lock:
            self.records[record["key"]] = record
            with self.path.open("a") as f:
                f.write(json.dumps(record) + "\n")

    def select(self, keys: Iterable[str]) -> list[dict[str, Any]]:
        return [self.records[k] for k in keys if k in self.records]
