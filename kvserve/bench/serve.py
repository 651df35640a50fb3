"""`kvserve bench serve`: the running service, over gRPC or HTTP, against the in-process engine.

The workload: `requests` prompts of `prompt_len` random token ids (the prompts of `kvserve bench
throughput`), each greedy with `ignore_eos`, so every request emits exactly `output_len` tokens.
At each concurrency level, `concurrency` streams are in flight at once (an asyncio semaphore),
first through the service, then on an in-process `AsyncLLMEngine` built with the service's
settings (model and context length from the ModelInfo RPC or /v1/models; the rest AppConfig's
defaults), so the cost of Ray Serve + the protocol is a ratio. `protocol` "grpc" streams through
Ray Serve's gRPC proxy (`kvserve.cluster.client.AsyncClient`); "http" streams /v1/completions
through
Serve's HTTP proxy (`kvserve.cluster.http_client.AsyncHTTPClient`, server-sent events, each chunk
carrying its token ids: vLLM's `return_token_ids`).

Measured per request: TTFT, the time from sending the request to the first message carrying
tokens; and ITL: every later message carrying k tokens, after a gap g since the previous one,
gives k samples of g / k (a coalesced message spreads its gap over its tokens; extra tokens in
the first message add no samples). Throughput is all output tokens / the level's wall time.
Percentiles are `kvserve.bench.common.percentile` (numpy's linear interpolation, as vLLM's
benchmark_serving), the same definition as `kvserve loadtest`'s.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import sys
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from tqdm import tqdm

from kvserve.bench.common import greedy_params, make_prompts, percentile
from kvserve.cluster.app import AppConfig
from kvserve.cluster.client import AsyncClient
from kvserve.cluster.http_client import AsyncHTTPClient
from kvserve.workers.async_engine import AsyncLLMEngine
from kvserve.workers.config import EngineConfig
from kvserve.workers.engine import LLMEngine

# One request: its prompt ids in, the token ids of each streamed message out.
StreamFn = Callable[[list[int]], AsyncIterator[Sequence[int]]]


@dataclass
class RequestTiming:
    ttft_ms: float
    itl_ms: list[float]  # one sample per token after the first message's
    output_tokens: int
    messages: int  # messages that carried tokens


@dataclass
class RunResult:
    """One side (service or engine) at one concurrency level."""

    concurrency: int
    seconds: float
    requests: list[RequestTiming]

    @property
    def output_tokens(self) -> int:
        return sum(r.output_tokens for r in self.requests)

    @property
    def tok_s(self) -> float:
        return self.output_tokens / self.seconds

    def ttft_ms(self, q: float) -> float:
        return percentile([r.ttft_ms for r in self.requests], q)

    def itl_ms(self, q: float) -> float:
        return percentile([x for r in self.requests for x in r.itl_ms], q)

    @property
    def tokens_per_message(self) -> float:
        return self.output_tokens / sum(r.messages for r in self.requests)


@dataclass
class LevelResult:
    """One row of the report (the `levels` entries of `--json`)."""

    concurrency: int
    service_tok_s: float
    engine_tok_s: float | None  # None with skip_engine
    ratio: float | None  # service_tok_s / engine_tok_s
    ttft_p50_ms: float
    ttft_p99_ms: float
    itl_p50_ms: float
    itl_p99_ms: float
    engine_ttft_p50_ms: float | None
    engine_itl_p50_ms: float | None
    tokens_per_message: float  # > 1 when the service coalesces tokens


@dataclass
class ServeBenchReport:
    levels: list[LevelResult]
    config: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"levels": [asdict(level) for level in self.levels], "config": self.config}


async def timed_request(stream: StreamFn, prompt_ids: list[int]) -> RequestTiming:
    """Run one request to its end, timing each message that carries tokens."""
    start_s = last_s = time.perf_counter()
    ttft_ms, itl_ms, tokens, messages = math.nan, [], 0, 0
    async for token_ids in stream(prompt_ids):
        if not token_ids:
            continue
        now_s = time.perf_counter()
        if messages == 0:
            ttft_ms = (now_s - start_s) * 1000
        else:
            itl_ms += [(now_s - last_s) * 1000 / len(token_ids)] * len(token_ids)
        last_s, tokens, messages = now_s, tokens + len(token_ids), messages + 1
    return RequestTiming(ttft_ms, itl_ms, tokens, messages)


async def run_level(stream: StreamFn, prompts: list[list[int]], concurrency: int,
                    output_len: int, desc: str, progress: bool) -> RunResult:
    """All prompts, at most `concurrency` in flight; checks each emitted `output_len` tokens."""
    gate = asyncio.Semaphore(concurrency)
    bar = tqdm(total=len(prompts), unit="req", desc=desc, file=sys.stderr, disable=not progress,
               leave=False)

    async def one(prompt_ids: list[int]) -> RequestTiming:
        async with gate:
            timing = await timed_request(stream, prompt_ids)
        bar.update(1)
        return timing

    start_s = time.perf_counter()
    timings = await asyncio.gather(*(one(p) for p in prompts))
    seconds = time.perf_counter() - start_s
    bar.close()
    short = [t.output_tokens for t in timings if t.output_tokens != output_len]
    if short:
        raise RuntimeError(f"{desc}: requests emitted {short} tokens, not {output_len}")
    return RunResult(concurrency, seconds, list(timings))


def service_stream(client: AsyncClient, output_len: int) -> StreamFn:
    async def stream(prompt_ids: list[int]) -> AsyncIterator[Sequence[int]]:
        async for msg in client.generate(prompt_token_ids=prompt_ids,
                                         **greedy_params(output_len)):
            yield msg.token_ids

    return stream


def http_stream(client: AsyncHTTPClient, output_len: int) -> StreamFn:
    async def stream(prompt_ids: list[int]) -> AsyncIterator[Sequence[int]]:
        async for chunk in client.completions(prompt_token_ids=prompt_ids,
                                              **greedy_params(output_len)):
            yield chunk["choices"][0]["token_ids"] if chunk["choices"] else []

    return stream


@dataclass(frozen=True)
class ServiceInfo:
    """What the benchmark needs of the served model, from either protocol."""

    model: str
    vocab_size: int
    max_model_len: int
    replicas: int


@contextlib.asynccontextmanager
async def _service(target: str, protocol: str, output_len: int
                   ) -> AsyncIterator[tuple[ServiceInfo, Callable[[int], StreamFn]]]:
    """The served model's description, and a StreamFn factory (by output length)."""
    if protocol == "http":
        async with AsyncHTTPClient(target) as http:
            card = await http.model_card()
            yield (ServiceInfo(card["id"], card["vocab_size"], card["max_model_len"],
                               card["replicas"]), lambda n: http_stream(http, n))
        return
    if protocol != "grpc":
        raise ValueError(f"protocol must be grpc or http, not {protocol!r}")
    async with AsyncClient(target) as client:
        info = await client.model_info()
        yield (ServiceInfo(info.model, info.vocab_size, info.max_model_len, info.replicas),
               lambda n: service_stream(client, n))


def engine_stream(engine: AsyncLLMEngine, output_len: int) -> StreamFn:
    async def stream(prompt_ids: list[int]) -> AsyncIterator[Sequence[int]]:
        async for out in engine.generate(prompt_token_ids=prompt_ids,
                                         params=greedy_params(output_len)):
            yield out.token_ids

    return stream


def engine_config_like_service(model: str, max_model_len: int,
                               threads: int | None) -> EngineConfig:
    """The engine a default replica builds (AppConfig's defaults) for the served model."""
    settings = AppConfig(model=model).engine_config()
    return EngineConfig(**(settings | {"max_model_len": max_model_len, "num_threads": threads}))


def level_result(service: RunResult, engine: RunResult | None) -> LevelResult:
    return LevelResult(
        concurrency=service.concurrency, service_tok_s=service.tok_s,
        engine_tok_s=engine.tok_s if engine else None,
        ratio=service.tok_s / engine.tok_s if engine else None,
        ttft_p50_ms=service.ttft_ms(50), ttft_p99_ms=service.ttft_ms(99),
        itl_p50_ms=service.itl_ms(50), itl_p99_ms=service.itl_ms(99),
        engine_ttft_p50_ms=engine.ttft_ms(50) if engine else None,
        engine_itl_p50_ms=engine.itl_ms(50) if engine else None,
        tokens_per_message=service.tokens_per_message,
    )


async def bench_serve(
    target: str, concurrency: Sequence[int] = (1, 8, 32), requests: int = 64,
    prompt_len: int = 128, output_len: int = 128, skip_engine: bool = False,
    engine_threads: int | None = 1, progress: bool = True, protocol: str = "grpc",
) -> ServeBenchReport:
    """Each concurrency level on the service, then (unless skip_engine) on the engine.

    `engine_threads`: torch threads of the in-process engine. Match the replica's: Ray sets
    OMP_NUM_THREADS to a replica's CPUs (`num_cpus_per_replica`, 1 by default); None leaves
    torch's default (all cores).
    """
    async with _service(target, protocol, output_len) as (info, streams):
        prompts = make_prompts(info.vocab_size, requests, prompt_len)
        on_service = streams(output_len)
        await run_level(streams(4), prompts[:2], 2, 4, "warm-up service", progress)
        async with _local_engine(info, engine_threads, skip_engine) as engine:
            if engine is not None:
                await run_level(engine_stream(engine, 4), prompts[:2], 2, 4, "warm-up engine",
                                progress)
            levels = [await _bench_level(on_service, engine, prompts, c, output_len, progress)
                      for c in concurrency]
    config = {"target": target, "protocol": protocol, "model": info.model,
              "replicas": info.replicas,
              "requests": requests, "prompt_len": prompt_len, "output_len": output_len,
              "engine_threads": engine_threads}
    return ServeBenchReport(levels, config)


@contextlib.asynccontextmanager
async def _local_engine(info: ServiceInfo, threads: int | None,
                        skip: bool) -> AsyncIterator[AsyncLLMEngine | None]:
    """The in-process engine the comparison runs on (None when skipped), shut down after."""
    if skip:
        yield None
        return
    engine = AsyncLLMEngine(LLMEngine(engine_config_like_service(
        info.model, info.max_model_len, threads)))
    try:
        yield engine
    finally:
        await engine.shutdown()


async def _bench_level(on_service: StreamFn, engine: AsyncLLMEngine | None,
                       prompts: list[list[int]], concurrency: int, output_len: int,
                       progress: bool) -> LevelResult:
    service = await run_level(on_service, prompts, concurrency, output_len,
                              f"service c={concurrency}", progress)
    on_engine = None
    if engine is not None:
        on_engine = await run_level(engine_stream(engine, output_len), prompts, concurrency,
                                    output_len, f"engine c={concurrency}", progress)
    return level_result(service, on_engine)


def run_serve_bench(target: str, **kwargs: Any) -> ServeBenchReport:
    """`bench_serve` from synchronous code; restores torch's thread count afterwards."""
    threads = torch.get_num_threads()
    try:
        return asyncio.run(bench_serve(target, **kwargs))
    finally:
        torch.set_num_threads(threads)


def summarize(report: ServeBenchReport) -> str:
    c = report.config
    lines = [
        f"{c['model']} at {c['target']} over {c.get('protocol', 'grpc')} ({c['replicas']} "
        f"replica(s)): {c['requests']} requests "
        f"x {c['prompt_len']} prompt + {c['output_len']} output tokens, greedy",
        f"{'conc':>5} {'service tok/s':>14} {'engine tok/s':>13} {'ratio':>6} "
        f"{'TTFT p50/p99 ms':>17} {'ITL p50/p99 ms':>15} {'tok/msg':>8}",
    ]
    return "\n".join(lines + [_row(level) for level in report.levels])


def _row(lv: LevelResult) -> str:
    engine = "-" if lv.engine_tok_s is None else f"{lv.engine_tok_s:.1f}"
    ratio = "-" if lv.ratio is None else f"{lv.ratio:.2f}"
    ttft = f"{lv.ttft_p50_ms:.1f}/{lv.ttft_p99_ms:.1f}"
    itl = f"{lv.itl_p50_ms:.1f}/{lv.itl_p99_ms:.1f}"
    return (f"{lv.concurrency:>5} {lv.service_tok_s:>14.1f} {engine:>13} {ratio:>6} "
            f"{ttft:>17} {itl:>15} {lv.tokens_per_message:>8.2f}")
