"""Where an eval's prompts are answered: in-process on the engine, or a running deployment.

Both take the same `GenRequest`s and give `GenResult`s in the same order, so an eval runs
unchanged in either place (`--target HOST:PORT` picks the deployment). In-process runs batch the
requests through the engine's continuous batching; remote runs stream them concurrently.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Protocol

from kvserve.cluster.client import Client, finish_reason_name
from kvserve.workers.config import EngineConfig
from kvserve.workers.engine import LLMEngine


@dataclass(frozen=True)
class GenRequest:
    request_id: str
    params: dict[str, Any]  # SamplingParams fields
    prompt: str | None = None
    messages: list[dict[str, str]] | None = None


@dataclass
class GenResult:
    request_id: str
    text: str
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str = ""


class Generator(Protocol):
    """Answers a batch of requests; `on_done` is called once per finished request."""

    def generate(self, requests: list[GenRequest],
                 on_done: Callable[[GenResult], None] | None = None) -> list[GenResult]: ...


class EngineGenerator:
    def __init__(self, config: EngineConfig) -> None:
        self.engine = LLMEngine(config)

    def generate(self, requests: list[GenRequest],
                 on_done: Callable[[GenResult], None] | None = None) -> list[GenResult]:
        results: dict[str, GenResult] = {}
        for r in requests:
            self.engine.add_request(prompt=r.prompt, messages=r.messages, params=r.params,
                                    request_id=r.request_id)
            results[r.request_id] = GenResult(r.request_id, "")
        for out in self.engine.run_until_done():
            result = results[out.request_id]
            result.text += out.text
            result.token_ids += out.token_ids
            if out.finished:
                result.finish_reason = out.finish_reason or ""
                if on_done:
                    on_done(result)
        return [results[r.request_id] for r in requests]


class GrpcGenerator:
    """A running deployment (`kvserve up`), `concurrency` streams at a time; a request the
    deployment refuses as overloaded is retried with backoff, as an eval must finish."""

    def __init__(self, target: str, concurrency: int = 16, timeout_s: float = 3600) -> None:
        self.client = Client(target, timeout=timeout_s)
        self.concurrency = concurrency
        self.timeout_s = timeout_s  # also how long a refused request keeps being retried

    def generate(self, requests: list[GenRequest],
                 on_done: Callable[[GenResult], None] | None = None) -> list[GenResult]:
        def one(r: GenRequest) -> GenResult:
            result = GenResult(r.request_id, "")
            for msg in self.client.generate(r.prompt, messages=r.messages,
                                            retry_refused_s=self.timeout_s, **r.params):
                result.text += msg.text
                result.token_ids += list(msg.token_ids)
                if msg.finish_reason:
                    result.finish_reason = finish_reason_name(msg.finish_reason)
            if on_done:
                on_done(result)
            return result

        with ThreadPoolExecutor(self.concurrency) as pool:
            return list(pool.map(one, requests))


def make_generator(config: EngineConfig, target: str | None) -> Generator:
    if target:
        return GrpcGenerator(target)
    return EngineGenerator(config)
