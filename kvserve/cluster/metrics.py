"""Service metrics with `ray.serve.metrics`, named like vLLM's (`kvserve_` prefix: Ray no longer
allows `:` in names). They reach the Ray dashboard and Prometheus as `ray_kvserve_*`."""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import AsyncIterator

from ray.serve.metrics import Counter, Gauge, Histogram

from kvserve.workers.core.outputs import KVCacheStats, RequestOutput, SpecDecodeStats
from kvserve.workers.core.timeline import StepTotals
from kvserve.workers.engine import LLMEngine

LATENCY_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                   2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0]

METRIC_NAMES = (
    "kvserve_time_to_first_token_seconds", "kvserve_inter_token_latency_seconds",
    "kvserve_e2e_request_latency_seconds", "kvserve_num_requests_running",
    "kvserve_num_requests_waiting", "kvserve_kv_cache_usage_perc", "kvserve_prompt_tokens_total",
    "kvserve_generation_tokens_total", "kvserve_request_success_total",
    # the step-time breakdown: seconds per step phase, and steps run
    "kvserve_step_phase_seconds_total", "kvserve_engine_steps_total",
    # speculative decoding, vLLM's spec_decode counters: acceptance rate is accepted /
    # draft tokens, mean accepted length 1 + accepted / drafts
    "kvserve_spec_decode_num_drafts_total", "kvserve_spec_decode_num_draft_tokens_total",
    "kvserve_spec_decode_num_accepted_tokens_total",
    "kvserve_spec_decode_num_accepted_tokens_per_pos_total",
)
# the KV cache's own: tokens for prefix caching, blocks and bytes for the host tier
KV_CACHE_METRIC_NAMES = (
    "kvserve_prefix_cache_queries_total", "kvserve_prefix_cache_hits_total",
    "kvserve_kv_host_cache_usage_perc", "kvserve_kv_blocks_offloaded_total",
    "kvserve_kv_blocks_restored_total", "kvserve_kv_blocks_swapped_total",
    "kvserve_kv_swap_bytes_total", "kvserve_kv_swap_seconds_total",
    "kvserve_num_preemptions_total",
)
# KVCacheStats counter -> (metric, tags) that grows by its increase
_KV_COUNTERS = {
    "prefix_queried_tokens": (0, {}), "prefix_hit_tokens": (1, {}),
    "blocks_offloaded": (3, {}), "blocks_restored": (4, {}),
    "blocks_swapped_out": (5, {"direction": "out"}), "blocks_swapped_in": (5, {"direction": "in"}),
    "swap_bytes": (6, {}), "swap_seconds": (7, {}), "preemptions": (8, {}),
}


def _kv_cache_metrics(tags: tuple[str, ...]) -> list:
    names = KV_CACHE_METRIC_NAMES
    return [
        Counter(names[0], "Prompt tokens looked up in the prefix cache.", tags),
        Counter(names[1], "Prompt tokens found in the prefix cache (either tier).", tags),
        Gauge(names[2], "Fraction of the host KV tier in use (0-1).", tags),
        Counter(names[3], "Cached KV blocks demoted from the device to the host tier.", tags),
        Counter(names[4], "Host-tier prefix hits copied back to the device (blocks).", tags),
        Counter(names[5], "KV blocks of preempted requests swapped out / in.",
                (*tags, "direction")),
        Counter(names[6], "Bytes copied between device and host KV tiers.", tags),
        Counter(names[7], "Seconds spent copying KV between device and host.", tags),
        Counter(names[8], "Requests preempted for lack of KV blocks.", tags),
    ]


class ServiceMetrics:
    def __init__(self, model: str) -> None:
        tags = ("model",)
        self.ttft = Histogram(METRIC_NAMES[0], "Time to first token.", LATENCY_BUCKETS, tags)
        self.itl = Histogram(METRIC_NAMES[1], "Time between streamed tokens.", LATENCY_BUCKETS,
                             tags)
        self.e2e = Histogram(METRIC_NAMES[2], "Request latency, end to end.", LATENCY_BUCKETS,
                             tags)
        self.running = Gauge(METRIC_NAMES[3], "Requests being decoded.", tags)
        self.waiting = Gauge(METRIC_NAMES[4], "Requests waiting for admission.", tags)
        self.kv_usage = Gauge(METRIC_NAMES[5], "Fraction of KV blocks in use (0-1).", tags)
        self.prompt_tokens = Counter(METRIC_NAMES[6], "Prompt tokens processed.", tags)
        self.generation_tokens = Counter(METRIC_NAMES[7], "Tokens generated.", tags)
        self.success = Counter(METRIC_NAMES[8], "Finished requests by reason.",
                               ("model", "finished_reason"))
        self.step_phase_seconds = Counter(
            METRIC_NAMES[9], "Seconds the engine's steps spent in each phase (propose, schedule, "
            "copy, prepare, forward, sample, detokenize).", ("model", "phase"))
        self.steps = Counter(METRIC_NAMES[10], "Engine steps that computed something.", tags)
        self.spec_drafts = Counter(METRIC_NAMES[11], "Speculative drafts verified (one per "
                                   "request per step that had drafts).", tags)
        self.spec_draft_tokens = Counter(METRIC_NAMES[12], "Speculative draft tokens verified.",
                                         tags)
        self.spec_accepted_tokens = Counter(METRIC_NAMES[13], "Speculative draft tokens the "
                                            "model accepted.", tags)
        self.spec_accepted_per_pos = Counter(
            METRIC_NAMES[14], "Draft tokens accepted at each position of a draft (0: first).",
            ("model", "position"))
        self._last_spec = SpecDecodeStats()
        self.kv_metrics = _kv_cache_metrics(tags)
        self._last_kv = KVCacheStats(*[0] * len(dataclasses.fields(KVCacheStats)))
        self._last_steps = StepTotals(0, {})
        for metric in (self.ttft, self.itl, self.e2e, self.running, self.waiting, self.kv_usage,
                       self.prompt_tokens, self.generation_tokens, self.success,
                       self.step_phase_seconds, self.steps, self.spec_drafts,
                       self.spec_draft_tokens, self.spec_accepted_tokens,
                       self.spec_accepted_per_pos, *self.kv_metrics):
            metric.set_default_tags({"model": model})

    def update_gauges(self, engine: LLMEngine) -> None:
        load = engine.load()
        self.running.set(load.running)
        self.waiting.set(load.waiting)
        self.kv_usage.set(load.kv_cache_usage)

    def update_kv_cache(self, stats: KVCacheStats) -> None:
        """Counters grow by what the engine's counters grew since the last call."""
        for field, (index, tags) in _KV_COUNTERS.items():
            increase = getattr(stats, field) - getattr(self._last_kv, field)
            if increase > 0:
                self.kv_metrics[index].inc(increase, tags=tags or None)
        if stats.host_blocks:
            self.kv_metrics[2].set(stats.host_used / stats.host_blocks)
        self._last_kv = stats

    def update_step_times(self, totals: StepTotals) -> None:
        """The step-time counters grow by what the engine's totals grew since the last call."""
        if totals.steps > self._last_steps.steps:
            self.steps.inc(totals.steps - self._last_steps.steps)
        for phase, seconds in totals.seconds.items():
            increase = seconds - self._last_steps.seconds.get(phase, 0.0)
            if increase > 0:
                self.step_phase_seconds.inc(increase, tags={"phase": phase})
        self._last_steps = totals

    def update_spec_decode(self, stats: SpecDecodeStats) -> None:
        """The speculative-decoding counters grow by what the engine's grew since the last
        call (nothing moves when speculation is off)."""
        last = self._last_spec
        for metric, now, before in (
                (self.spec_drafts, stats.num_drafts, last.num_drafts),
                (self.spec_draft_tokens, stats.num_draft_tokens, last.num_draft_tokens),
                (self.spec_accepted_tokens, stats.num_accepted_tokens, last.num_accepted_tokens)):
            if now > before:
                metric.inc(now - before)
        per_pos = list(stats.accepted_per_position)
        for i, n in enumerate(per_pos):
            before = last.accepted_per_position[i] if i < len(last.accepted_per_position) else 0
            if n > before:
                self.spec_accepted_per_pos.inc(n - before, tags={"position": str(i)})
        self._last_spec = SpecDecodeStats(stats.num_drafts, stats.num_draft_tokens,
                                          stats.num_accepted_tokens, per_pos)

    async def track(self, stream: AsyncIterator[RequestOutput], engine: LLMEngine
                    ) -> AsyncIterator[RequestOutput]:
        """Re-yield an engine output stream (gRPC's or HTTP's), observing latencies and token
        counts on the way. Closing this stream closes `stream` (which aborts its request)."""
        start = last = time.monotonic()
        first = True
        async with contextlib.aclosing(stream):
            async for out in stream:
                now = time.monotonic()
                if out.token_ids:
                    (self.ttft if first else self.itl).observe(now - last)
                    first, last = False, now
                    self.generation_tokens.inc(len(out.token_ids))
                if out.finished:
                    self.e2e.observe(now - start)
                    if out.usage is not None:
                        self.prompt_tokens.inc(out.usage.prompt_tokens)
                    self.success.inc(tags={"finished_reason": out.finish_reason})
                self.update_gauges(engine)
                if len(out.token_ids) > 1:  # a verifying step emitted drafts: count them now
                    self.update_spec_decode(engine.spec_stats)
                yield out
        self.update_gauges(engine)
        self.update_kv_cache(engine.kv_stats())  # once per stream: off the per-token path
        self.update_step_times(engine.step_totals())
        self.update_spec_decode(engine.spec_stats)
