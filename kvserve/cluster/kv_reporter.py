"""A replica's side of the cache manager: its KV events, batched, sent from a daemon thread.

Every `interval_s` the reporter drains the engine's KV events (block stored / removed, per tier)
and, if there were any, or a heartbeat is due, sends one report: the net change per block hash,
the live requests with their block counts, and the usage counters. Never on the per-token path.
When the manager asks for it (its restart, a Redis restart, a lost lease) or a call failed, the
next report is full: every cached hash, replacing what Redis has.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import ray

from kvserve.cache_manager.index import REPORT_INTERVAL_MS, ReplicaReport, ReplicaUsage
from kvserve.cache_manager.manager import ReplicaState
from kvserve.workers.core.kv_events import KVEvent
from kvserve.workers.engine import LLMEngine

logger = logging.getLogger(__name__)


class KVReporter:
    def __init__(self, engine: LLMEngine, manager: Any, replica_id: str,
                 interval_s: float = REPORT_INTERVAL_MS / 1000, heartbeat_s: float = 1.0,
                 call_timeout_s: float = 2.0) -> None:
        self.engine = engine
        self.manager = manager
        self.replica_id = replica_id
        self.interval_s, self.heartbeat_s, self.call_timeout_s = (
            interval_s, heartbeat_s, call_timeout_s)
        engine.kv_events.enabled = True
        self._needs_full = True
        self._last_sent = 0.0
        self._lock = threading.Lock()  # one report at a time: the thread's and flush()'s
        self._stop = threading.Event()
        self.num_failures = 0

    def state(self) -> ReplicaState:
        """What this replica holds now (for `kvserve cache check`)."""
        hashes = self.engine.cached_block_hashes()
        return ReplicaState(self.replica_id, [h.hex() for h in hashes["device"]],
                            [h.hex() for h in hashes["host"]], self._requests())

    def send_once(self, force: bool = False) -> None:
        with self._lock:
            events = self.engine.kv_events.drain()  # before a full snapshot: it supersedes them
            due = time.monotonic() - self._last_sent >= self.heartbeat_s
            if not (events or due or force or self._needs_full):
                return
            report = self._full_report() if self._needs_full else self._delta_report(events)
            try:
                self._needs_full = ray.get(self.manager.report.remote(report),
                                           timeout=self.call_timeout_s)
            except Exception:  # noqa: BLE001 - the manager restarts; serving must go on
                self._needs_full = True
                self.num_failures += 1
                if self.num_failures == 1:
                    logger.warning("kvserve: cache manager unreachable", exc_info=True)
            self._last_sent = time.monotonic()

    def start(self) -> KVReporter:
        threading.Thread(target=self._run, name="kvserve-kv-reporter", daemon=True).start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.send_once()

    def _full_report(self) -> ReplicaReport:
        state = self.state()
        return ReplicaReport(self.replica_id, self._usage(),
                             stored={"device": state.device, "host": state.host},
                             requests=state.requests, full=True)

    def _delta_report(self, events: list[KVEvent]) -> ReplicaReport:
        last: dict[tuple[str, bytes], str] = {}
        for event in events:  # net change per block: the last event wins
            last[(event.tier, event.block_hash)] = event.kind
        stored: dict[str, list[str]] = {"device": [], "host": []}
        removed: dict[str, list[str]] = {"device": [], "host": []}
        for (tier, block_hash), kind in last.items():
            (stored if kind == "stored" else removed)[tier].append(block_hash.hex())
        return ReplicaReport(self.replica_id, self._usage(), stored, removed, self._requests())

    def _requests(self) -> dict[str, int]:
        return self.engine.request_blocks()

    def _usage(self) -> ReplicaUsage:
        s = self.engine.kv_stats()
        return ReplicaUsage(s.device_blocks, s.device_used, s.device_cached, s.host_blocks,
                            s.host_used, s.host_cached, s.prefix_queried_tokens,
                            s.prefix_hit_tokens, self.engine.info.block_size)
