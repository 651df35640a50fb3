"""Service metrics with `ray.serve.metrics`, named like vLLM's (`kvserve_` prefix: Ray no longer
allows `:` in names). They reach the Ray dashboard and Prometheus as `ray_kvserve_*`."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

from ray.serve.metrics import Counter, Gauge, Histogram

from kvserve.v1 import generation_pb2 as pb
from workers.engine import LLMEngine

LATENCY_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                   2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0]
FINISH_NAMES = {pb.FINISH_REASON_STOP: "stop", pb.FINISH_REASON_LENGTH: "length",
                pb.FINISH_REASON_ABORT: "abort"}

METRIC_NAMES = (
    "kvserve_time_to_first_token_seconds", "kvserve_inter_token_latency_seconds",
    "kvserve_e2e_request_latency_seconds", "kvserve_num_requests_running",
    "kvserve_num_requests_waiting", "kvserve_kv_cache_usage_perc", "kvserve_prompt_tokens_total",
    "kvserve_generation_tokens_total", "kvserve_request_success_total",
)


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
        for metric in (self.ttft, self.itl, self.e2e, self.running, self.waiting, self.kv_usage,
                       self.prompt_tokens, self.generation_tokens, self.success):
            metric.set_default_tags({"model": model})

    def update_gauges(self, engine: LLMEngine) -> None:
        running, waiting, kv_usage = engine.load()
        self.running.set(running)
        self.waiting.set(waiting)
        self.kv_usage.set(kv_usage)

    async def track(
        self, stream: AsyncIterator[pb.GenerateResponse], engine: LLMEngine
    ) -> AsyncIterator[pb.GenerateResponse]:
        """Re-yield a response stream, observing latencies and token counts on the way."""
        start = last = time.monotonic()
        first = True
        async for msg in stream:
            now = time.monotonic()
            if msg.token_ids:
                (self.ttft if first else self.itl).observe(now - last)
                first, last = False, now
                self.generation_tokens.inc(len(msg.token_ids))
            if msg.finish_reason:
                self.e2e.observe(now - start)
                self.prompt_tokens.inc(msg.usage.prompt_tokens)
                self.success.inc(tags={"finished_reason": FINISH_NAMES[msg.finish_reason]})
            self.update_gauges(engine)
            yield msg
        self.update_gauges(engine)
