"""An asyncio front for the engine: one background step loop, per-request output streams.

Steps run in a worker thread (torch releases the GIL), so the event loop keeps serving clients
while the model computes. The engine's state is only touched between steps: new requests and
aborts are queued by the event loop and applied by the step loop before the next step.

If the step loop dies (a step raised, e.g. on a CUDA fault, or the loop was cancelled), the
engine is dead for good rather than restarted: a step that failed once (a poisoned CUDA
context) would fail every request after it. Open streams and new requests get EngineDeadError
at once, and `check_health` raises, so Ray Serve replaces the replica.

It reads the engine only through LLMEngine's public methods and snapshots (`scheduler_stats`,
`prompt_seconds`, `warming_up`, ...), never its scheduler or block manager; front ends read
the model's description and tokenize through this class (`info`, `tokenize`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from kvserve.workers.core.outputs import RequestOutput, SchedulerStats
from kvserve.workers.core.sampling_params import SamplingParams
from kvserve.workers.core.sequence import Sequence
from kvserve.workers.engine import LLMEngine, ModelInfo
from kvserve.workers.errors import (
    EngineDeadError,
    EngineShutdownError,
    InvalidRequestError,
    QueueFullError,
)

logger = logging.getLogger(__name__)

# wraps a request's output stream (a front end's metrics); closing the wrapper must close it
Observer = Callable[[AsyncIterator[RequestOutput]], AsyncIterator[RequestOutput]]
WARM_UP_PROMPT = "Hello"  # a token or two: the cheapest request that still tokenizes text
WARM_UP_TOKENS = 2  # one prefill step and one decode step: both attention paths run


@dataclass(frozen=True)
class WarmUp:
    """What `AsyncLLMEngine.warm_up` ran: proof that the whole path works on this device."""

    prompt_tokens: int
    generated_tokens: int
    seconds: float


class AsyncLLMEngine:
    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._streams: dict[str, asyncio.Queue[RequestOutput | BaseException]] = {}
        self._new: list[Sequence] = []
        self._aborts: list[str] = []
        self._wake = asyncio.Event()
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvserve-step")
        self._loop_task: asyncio.Task | None = None
        self._closed = False
        self._death: BaseException | None = None  # what killed the step loop
        self.warmed_up: WarmUp | None = None

    @property
    def info(self) -> ModelInfo:
        """What this engine serves (the ModelInfo RPC)."""
        return self.engine.info

    def tokenize(
        self, *, prompt: str | None = None, prompt_token_ids: list[int] | None = None,
        messages: list[dict[str, str]] | None = None,
    ) -> list[int]:
        """The token ids a request with this input would get. Reads only the tokenizer, never
        the engine's state, so it is safe while a step runs."""
        return self.engine.tokenize(prompt=prompt, prompt_token_ids=prompt_token_ids,
                                    messages=messages)

    def detokenize(self, token_ids: list[int]) -> str:
        return self.engine.detokenize(token_ids)

    def token_texts(self, token_ids: list[int]) -> list[str]:
        return self.engine.token_texts(token_ids)

    async def generate(
        self, *, prompt: str | None = None, prompt_token_ids: list[int] | None = None,
        messages: list[dict[str, str]] | None = None,
        params: SamplingParams | dict[str, Any] | None = None, request_id: str | None = None,
        cache_salt: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Stream a request's outputs; the last one carries finish_reason and usage.

        Raises InvalidRequestError on bad input, QueueFullError when `max_waiting_requests`
        are already waiting, the waiting ones need `max_waiting_kv_pools` pools of KV or the
        prompt work ahead would take more than `max_expected_wait_s`,
        EngineShutdownError once shutdown began (also to open streams), EngineDeadError once
        the step loop died (also to open streams).
        Leaving the iteration early (break, cancel) aborts the request and frees its KV blocks.
        """
        self.check_health()
        if _constrained(params):  # compiled off this loop and off the step loop
            await asyncio.get_running_loop().run_in_executor(
                None, self.engine.compile_grammar, params)
        seq = self.engine.make_sequence(
            prompt=prompt, prompt_token_ids=prompt_token_ids, messages=messages,
            params=params, request_id=request_id, cache_salt=cache_salt,
        )
        stream = self._open(seq)
        finished = False
        try:
            while not finished:
                item = await stream.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
        finally:
            self._streams.pop(seq.request_id, None)
            if not finished:
                self._abort_later(seq.request_id)

    def _check_admission(self, seq: Sequence) -> None:
        """Refuse `seq` when the waiting queue is full: by count, by the KV it will need, or by
        the time the prompt work ahead of it would take."""
        core, config = self.engine, self.engine.config
        stats, new = core.scheduler_stats(), list(self._new)
        num_waiting = stats.num_waiting + len(new)
        # a burst on an idle replica fills the free batch slots first; only the rest must queue
        free_slots = max(0, config.max_num_seqs - stats.num_running)
        if num_waiting - free_slots >= config.max_waiting_requests:
            raise QueueFullError(max(0, num_waiting - free_slots), config.max_waiting_requests)
        num_blocks = core.info.num_blocks
        limit = int(config.max_waiting_kv_pools * num_blocks)
        needed = stats.waiting_kv_blocks + sum(core.kv_blocks_at_longest(s) for s in [*new, seq])
        if needed > limit:
            raise QueueFullError(needed, limit, "KV blocks needed by requests",
                                 f"max_waiting_kv_pools={config.max_waiting_kv_pools:g} x "
                                 f"{num_blocks} blocks")
        self._check_expected_wait(seq, stats, new)

    def _check_expected_wait(self, seq: Sequence, stats: SchedulerStats,
                             new: list[Sequence]) -> None:
        """Refuse when the prompt work ahead plus `seq`'s own would outlast
        `max_expected_wait_s`: its time to first token. An idle replica admits any prompt."""
        limit = self.engine.config.max_expected_wait_s
        if limit is None or not (stats.num_running or stats.num_waiting or new):
            return
        left = (s.num_tokens - s.num_computed_tokens for s in new)
        # a decode's 1 is its share of every step: not work ahead
        work = stats.prompt_tokens_left + sum(n for n in left if n > 1) + seq.num_prompt_tokens
        wait = self.engine.prompt_seconds(work, stats.num_decoding)
        if wait is not None and wait > limit:
            rate = self.engine.prefill_tokens_per_s or 0.0
            raise QueueFullError(round(wait), round(limit),
                                 f"s of prompt work up to its first token ({work} tokens at "
                                 f"{rate:.0f} tokens/s)", "max_expected_wait_s")

    def _open(self, seq: Sequence) -> asyncio.Queue:
        if seq.request_id in self._streams or self.engine.has_request(seq.request_id):
            raise InvalidRequestError("request_id", f"{seq.request_id!r} is already running")
        self._check_admission(seq)
        stream: asyncio.Queue = asyncio.Queue()
        self._streams[seq.request_id] = stream
        self._new.append(seq)
        self._ensure_loop()
        self._wake.set()
        return stream

    def abort(self, request_id: str) -> None:
        """Abort a request; its blocks are freed before the next step."""
        self._abort_later(request_id)

    def _abort_later(self, request_id: str) -> None:
        self._aborts.append(request_id)
        self._wake.set()

    def check_health(self) -> None:
        """Raise unless this engine can serve: EngineDeadError (its cause: what killed the
        step loop) once the loop died, EngineShutdownError after `shutdown`. Ray Serve's
        health check calls it, so a replica with a dead loop is replaced instead of answering
        every request with an error. Cheap: no step, no lock."""
        if self._closed:
            raise EngineShutdownError()
        task = self._loop_task
        if self._death is None and task is not None and task.done():  # ended some other way
            self._death = RuntimeError("the step loop ended")
        if self._death is not None:
            raise EngineDeadError.caused_by(self._death)

    async def warm_up(self, prompt: str = WARM_UP_PROMPT,
                      max_tokens: int = WARM_UP_TOKENS) -> WarmUp:
        """Run one short request through the whole path (tokenize, schedule, model step,
        sample, detokenize) before serving: an engine that cannot generate on this device fails
        here, at start-up, and the first user request does not pay the one-time costs (CUDA
        context and kernels, allocator growth).

        It leaves nothing behind that a user request would not: its KV blocks are freed when it
        finishes, and prefix caching is off while it runs, so it caches no block, records no KV
        event and counts no prefix-cache query. Its cold first step is not kept as the measured
        prompt throughput either. Call it before anything reports on the engine (the cluster's
        KV reporter, metrics) and before any request; raises whatever the request raised."""
        core = self.engine
        if core.has_unfinished() or self._streams or self._new:
            raise RuntimeError("warm_up must run before any request")
        params = {"max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
        start = time.perf_counter()
        # entered while no step runs (the loop is idle or not started) and left after the
        # last output, which comes after its step returned: no step runs then either
        with core.warming_up():
            outs = [out async for out in self.generate(
                prompt=prompt, params=params, request_id=f"kvserve-warm-up-{uuid.uuid4().hex}")]
        generated = sum(len(out.token_ids) for out in outs)
        last = outs[-1] if outs else None
        if last is None or last.usage is None or generated != max_tokens:
            raise RuntimeError(f"the warm-up request made {generated} of {max_tokens} tokens")
        self.warmed_up = WarmUp(last.usage.prompt_tokens, generated,
                                time.perf_counter() - start)
        return self.warmed_up

    def _ensure_loop(self) -> None:
        if self._loop_task is None:  # once: a loop that ended is dead (check_health says so)
            self._loop_task = asyncio.get_running_loop().create_task(
                self._run(), name="kvserve-step-loop")

    async def _run(self) -> None:
        """The step loop; anything escaping it kills the engine (`_die`), except shutdown's
        cancellation."""
        try:
            await self._step_until_cancelled()
        except asyncio.CancelledError:
            if not self._closed:
                self._die(RuntimeError("the step loop was cancelled"))
            raise
        except Exception as exc:  # noqa: BLE001 - recorded for check_health, logged here
            logger.error("kvserve: the engine's step loop died", exc_info=exc)
            self._die(exc)

    async def _step_until_cancelled(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await self._wake.wait()
            self._apply_pending()
            if not self.engine.has_unfinished():
                self._wake.clear()
                continue
            outputs = await loop.run_in_executor(self._executor, self.engine.step)
            for out in outputs:
                self._deliver(out)

    def _die(self, cause: BaseException) -> None:
        """The loop is dead: every open stream fails now rather than hang, and the requests'
        KV blocks are freed on the step thread, after any step still in flight there."""
        self._death = cause
        self._new.clear()
        for stream in self._streams.values():
            stream.put_nowait(EngineDeadError.caused_by(cause))
        if not self._closed:
            self._executor.submit(self._abort_everything)

    def _abort_everything(self) -> None:
        for request_id in self.engine.request_ids():
            try:
                self.engine.abort(request_id)
            except Exception:  # noqa: BLE001 - best effort: the replica is replaced anyway
                logger.warning("kvserve: could not free request %s", request_id, exc_info=True)

    def _apply_pending(self) -> None:
        new, self._new = self._new, []
        for seq in new:
            if seq.request_id in self._streams:  # its consumer may already have gone
                self.engine.enqueue(seq)
        aborts, self._aborts = self._aborts, []
        for request_id in aborts:
            out = self.engine.abort(request_id)
            if out is not None:
                self._deliver(out)

    def _deliver(self, out: RequestOutput) -> None:
        stream = self._streams.get(out.request_id)
        if stream is not None:
            stream.put_nowait(out)

    def _fail_all(self, exc: BaseException) -> None:
        for stream in self._streams.values():
            stream.put_nowait(exc)

    async def shutdown(self) -> None:
        """Stop serving: new requests and every open stream get EngineShutdownError, and every
        request's KV blocks are freed. The step in flight (if any) completes first. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._loop_task is not None:
            self._loop_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._loop_task
        await asyncio.get_running_loop().run_in_executor(self._executor, _no_op)
        self._new.clear()
        self._aborts.clear()
        self._fail_all(EngineShutdownError())
        for request_id in self.engine.request_ids():
            self.engine.abort(request_id)
        self._executor.shutdown(wait=True)
        self.engine.shutdown()  # tensor-parallel ranks, if any


def unobserved(stream: AsyncIterator[RequestOutput]) -> AsyncIterator[RequestOutput]:
    """The Observer that observes nothing."""
    return stream


def _no_op() -> None:
    """Queued behind the step in flight on the single step thread: awaiting it waits for it."""


def _constrained(params: SamplingParams | dict[str, Any] | None) -> bool:
    """The request carries a structured-output constraint (a grammar to compile)."""
    if isinstance(params, dict):
        return params.get("structured_outputs") is not None
    return getattr(params, "structured_outputs", None) is not None
