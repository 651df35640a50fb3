"""The synchronous engine core: requests in, one scheduled model step at a time, outputs out.

A step is nano-vllm's loop: the scheduler picks the chunks, the model runner computes them, the
sampler picks tokens, the scheduler's `update_from_output` appends them, runs the stop checks
and frees finished requests, and the engine turns them into text. The engine itself only
detokenizes (stop strings need text) and builds outputs.

Everything above this module (the async engine, the cluster's service, KV reporter, metrics and
status) reads the engine through its public methods and frozen snapshots (`load`,
`scheduler_stats`, `kv_stats`, `info`, `request_blocks`, `cached_block_hashes`), never through
the scheduler or the block manager, so those can change without touching the cluster. Profilers
and benchmarks watch steps through `observe_steps` (a `StepRecord` per step: batch and phase
times) instead of wrapping the engine's parts; the recorder keeps the last `timeline_steps` of
them (`recent_steps`) and each request's events, handed back on its last output
(`kvserve/workers/core/timeline.py`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import secrets
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

import torch

from kvserve.workers.config import DTYPES, EngineConfig
from kvserve.workers.core.block_manager import BlockManager
from kvserve.workers.core.detokenizer import IncrementalDetokenizer
from kvserve.workers.core.host_block_pool import HostBlockPool
from kvserve.workers.core.inputs import to_token_ids
from kvserve.workers.core.kv_events import KVEvents
from kvserve.workers.core.ngram_proposer import NgramProposer
from kvserve.workers.core.outputs import (
    KVCacheStats,
    RequestOutput,
    SchedulerStats,
    SpecDecodeStats,
    TokenLogprobs,
    Usage,
)
from kvserve.workers.core.prefill_rate import PrefillRate
from kvserve.workers.core.sampling_params import SamplingParams
from kvserve.workers.core.scheduler import Scheduler, SchedulerOutput
from kvserve.workers.core.sequence import FinishReason, Sequence
from kvserve.workers.core.timeline import (
    PHASES,
    ChunkRecord,
    Preemption,
    RequestTimeline,
    StepHistory,
    StepRecord,
    StepTotals,
    TimelineEvent,
    preemption_events,
    step_events,
)
from kvserve.workers.errors import InvalidRequestError
from kvserve.workers.model_executor.attention import (
    PagedAttention,
    make_backend,
    resolve_backend_name,
)
from kvserve.workers.model_executor.cpu_kernels import CpuKernels, load_cpu_kernels
from kvserve.workers.model_executor.cuda_graphs import graph_batch_sizes, graph_memory_bytes
from kvserve.workers.model_executor.draft_proposer import DraftModelProposer
from kvserve.workers.model_executor.kv_cache import KVCacheSpec
from kvserve.workers.model_executor.loader import (
    DEFAULT_MODEL,
    LoadedCheckpoint,
    load_checkpoint,
    with_rope_override,
)
from kvserve.workers.model_executor.model import CausalLM, onednn_available
from kvserve.workers.model_executor.model_runner import ForwardView, ModelRunner
from kvserve.workers.model_executor.rejection_sampler import Verified, sample_and_verify
from kvserve.workers.model_executor.rope import RotaryEmbedding


@dataclass(frozen=True)
class ModelInfo:
    """What this engine serves and how (the ModelInfo RPC, benchmark reports)."""

    name: str
    vocab_size: int
    max_model_len: int
    rope_parameters: dict[str, Any]
    dtype: str
    device: str
    attention_backend: str
    block_size: int
    num_blocks: int
    num_host_blocks: int
    cuda_graph_sizes: tuple[int, ...] = ()  # decode batch sizes replayed from CUDA graphs


class EngineLoad(NamedTuple):
    """What gauges and the status rows show. Lengths and one ratio: cheap, and safe to read
    from another thread while a step runs."""

    running: int
    waiting: int
    kv_cache_usage: float  # 0-1
    # the KV pools' pages in this process's RAM: on CPU they are committed as blocks are first
    # written, so the pool's share of a replica's RSS grows to its configured size, and a soak
    # that watches RSS for leaks takes it out (kvserve/cluster/memory_watch.py); 0 for a GPU pool
    # (the
    # pinned host tier of a GPU engine is committed whole at start)
    kv_pool_ram_bytes: int = 0


class Proposer(Protocol):
    """Where speculative drafts come from (`NgramProposer`, `DraftModelProposer`)."""

    def propose(self, requests: list[tuple[Sequence, int]]) -> list[list[int]]:
        """Up to k draft tokens to follow each (decoding sequence, k)."""
        ...

    def forget(self, request_id: str) -> None:
        """The request ended: drop whatever is kept for it."""
        ...


@dataclass
class _Request:
    seq: Sequence
    detok: IncrementalDetokenizer


class LLMEngine:
    def __init__(
        self, config: EngineConfig | None = None, checkpoint: LoadedCheckpoint | None = None,
        draft_checkpoint: LoadedCheckpoint | None = None,
    ) -> None:
        """`checkpoint` (e.g. `tiny.tiny_checkpoint()`) replaces loading `config.model`, and
        `draft_checkpoint` loading `config.draft_model` (speculative_method draft_model)."""
        self.config = config = config or EngineConfig()
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        self.device = _resolve_device(config.device)
        self.dtype = _resolve_dtype(config.dtype, self.device)
        # on a new machine the kernel build (a compiler in subprocesses) and the model's first
        # conversion (Python, mostly one core) take ~20 s each: side by side, not one after the
        # other (measured on 2 cores they only share the cores: 41.6 s either way; hosts with
        # more cores overlap them)
        pool = ThreadPoolExecutor(1, thread_name_prefix="kvserve-kernels")
        kernels = pool.submit(_cpu_kernels, self.device, self.dtype)
        try:
            ckpt = with_rope_override(
                checkpoint or load_checkpoint(config.model), config.rope_parameters
            )
        finally:
            pool.shutdown(wait=False)  # a missing model is reported without waiting for a build
        cpu_kernels = kernels.result()
        self.hf_config, self.tokenizer, self.model_path = ckpt.config, ckpt.tokenizer, ckpt.path
        self.vocab_size = ckpt.config.vocab_size
        self.max_model_len = _max_model_len(config, ckpt.config)
        backend_name = resolve_backend_name(config.attention_backend, self.device)
        self.model = _build_model(ckpt, self.device, self.dtype, cpu_kernels,
                                  triton=backend_name == "triton")
        # the decode attention kernel runs fp32 and bf16: other dtypes take the torch backend
        attention_kernels = cpu_kernels if self.dtype in (torch.float32, torch.bfloat16) else None
        backend = make_backend(backend_name, attention_kernels)
        backend_name = backend.name
        block_size = _resolve_block_size(config.block_size, backend, self.dtype)
        spec = _kv_spec(ckpt.config, block_size, self.dtype)
        graphs = _uses_graphs(config, self.device, backend)
        graph_bytes = _graph_bytes(config, ckpt.config, spec, self.max_model_len) if graphs else 0
        num_blocks = config.num_kv_blocks or spec.num_blocks_for(
            _kv_budget(config, self.device, graph_bytes))
        if num_blocks < 1:
            raise ValueError("kv_cache_memory is smaller than one KV block")
        num_host_blocks = config.num_host_kv_blocks
        if num_host_blocks is None:
            num_host_blocks = spec.num_blocks_for(config.cpu_offload_memory)
        rope = RotaryEmbedding(ckpt.config, self.max_model_len, self.device, self.dtype)
        self.runner = ModelRunner(self.model, spec, num_blocks, rope, backend, self.device,
                                  num_host_blocks)
        if graphs:  # captured before any request: at a replica's start, before it is ready
            self.runner.enable_decode_graphs(graph_batch_sizes(config.max_num_seqs),
                                             self.max_model_len, capture=True)
        self.bytes_per_block = spec.bytes_per_block
        self.kv_events = KVEvents()  # the cluster turns it on to report to its cache manager
        host = HostBlockPool(num_host_blocks, self.kv_events) if num_host_blocks else None
        self.block_manager = BlockManager(
            num_blocks, block_size, enable_caching=config.enable_prefix_caching,
            host=host, events=self.kv_events)
        self.swap_seconds = 0.0  # time spent in KV copies between device and host
        self.num_steps = 0
        self.history = StepHistory(config.timeline_steps)
        self._phase_seconds = [0.0] * len(PHASES)  # since start, recorder on or off
        self.block_manager.track_activity = self.history.enabled
        self._step_observers: list[tuple[Callable[[StepRecord], None], bool]] = []
        self._forward_observers: list[Callable[[ForwardView], None]] = []
        self.prefill_rate = PrefillRate(config.max_num_batched_tokens)
        self.eos_token_ids = _eos_ids(ckpt)
        self.scheduler = Scheduler(
            self.block_manager, config.max_num_seqs, config.max_num_batched_tokens,
            self.max_model_len, self.eos_token_ids,
        )
        self._info = ModelInfo(
            name=config.model or DEFAULT_MODEL,
            vocab_size=self.vocab_size,
            max_model_len=self.max_model_len,
            rope_parameters=dict(ckpt.config.rope_parameters),
            dtype=str(self.dtype).removeprefix("torch."),
            device=str(self.device),
            attention_backend=backend_name,
            block_size=block_size,
            num_blocks=num_blocks,
            num_host_blocks=num_host_blocks,
            cuda_graph_sizes=tuple(self.runner.graphs.sizes) if self.runner.graphs else (),
        )
        self.requests: dict[str, _Request] = {}
        self.proposer = self._make_proposer(ckpt, draft_checkpoint, cpu_kernels, block_size,
                                            num_blocks)
        self.spec_stats = SpecDecodeStats()

    def _make_proposer(self, target: LoadedCheckpoint, draft: LoadedCheckpoint | None,
                       cpu_kernels: CpuKernels | None, block_size: int,
                       num_blocks: int) -> Proposer | None:
        """The speculative_method's proposer. A draft model gets its own runner and KV pool
        (as many blocks as the target's), on the target's device and attention backend; the
        target as its own draft shares its weights."""
        config = self.config
        if config.speculative_method == "ngram":
            return NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
        if config.speculative_method != "draft_model":
            return None
        if draft is None and config.draft_model is not None:
            draft = load_checkpoint(config.draft_model)
        if draft is not None and draft.config.vocab_size != self.vocab_size:
            raise ValueError(f"draft_model: its vocabulary has {draft.config.vocab_size} tokens, "
                             f"the target's {self.vocab_size}; they must share a tokenizer")
        draft = draft or target
        model = (self.model if draft is target
                 else _build_model(draft, self.device, self.dtype, cpu_kernels))
        spec = _kv_spec(draft.config, block_size, self.dtype)
        rope = RotaryEmbedding(draft.config, self.max_model_len, self.device, self.dtype)
        runner = ModelRunner(model, spec, num_blocks, rope, self.runner.backend, self.device)
        return DraftModelProposer(runner, BlockManager(num_blocks, block_size))

    @property
    def info(self) -> ModelInfo:
        return self._info

    def use_attention_backend(self, backend: PagedAttention) -> None:
        """Run attention through `backend` from the next step on (tests and GPU checks swap in
        backends an EngineConfig cannot name); `info` says which backend runs."""
        self.runner.backend = backend
        self._info = dataclasses.replace(self._info, attention_backend=backend.name)

    # -- requests -------------------------------------------------------------------------
    def add_request(self, **request: Any) -> str:
        """Validate and queue a request (the arguments of `make_sequence`); returns its id.

        Raises InvalidRequestError, leaving all else untouched."""
        seq = self.make_sequence(**request)
        self.enqueue(seq)
        return seq.request_id

    def make_sequence(
        self,
        *,
        prompt: str | None = None,
        prompt_token_ids: list[int] | None = None,
        messages: list[dict[str, str]] | None = None,
        params: SamplingParams | dict[str, Any] | None = None,
        request_id: str | None = None,
        cache_salt: str | None = None,
    ) -> Sequence:
        """Validation only: builds the sequence without touching the engine's state.

        `cache_salt` (per tenant) keeps prefix-cache hits within requests that share it."""
        params = _as_params(params)
        params.validate(self.vocab_size)
        ids = self.tokenize(prompt=prompt, prompt_token_ids=prompt_token_ids, messages=messages)
        self._check_lengths(len(ids), params)
        request_id = request_id or uuid.uuid4().hex
        if not isinstance(request_id, str):
            raise InvalidRequestError("request_id", "must be a string")
        seed = params.seed if params.seed is not None else secrets.randbits(63)
        generator = torch.Generator().manual_seed(seed)
        if cache_salt is not None and not isinstance(cache_salt, str):
            raise InvalidRequestError("cache_salt", "must be a string")
        return Sequence(request_id, ids, params, generator,
                        cache_salt=_salt(cache_salt or "", self.runner.rope.cache_key(len(ids))))

    def tokenize(
        self, *, prompt: str | None = None, prompt_token_ids: list[int] | None = None,
        messages: list[dict[str, str]] | None = None,
    ) -> list[int]:
        """The token ids a request with this input would get (the Tokenize RPC)."""
        return to_token_ids(self.tokenizer, self.vocab_size, prompt=prompt,
                            prompt_token_ids=prompt_token_ids, messages=messages)

    def detokenize(self, token_ids: list[int]) -> str:
        """The text of `token_ids` (a prompt given as ids, echoed back by the HTTP API)."""
        return self.tokenizer.decode(token_ids)

    def token_texts(self, token_ids: list[int]) -> list[str]:
        """Each token's own text, as logprobs name tokens (a byte-level piece of a longer
        character decodes to U+FFFD, as in vLLM)."""
        return [self.tokenizer.decode([t]) for t in token_ids]

    def enqueue(self, seq: Sequence) -> None:
        if seq.request_id in self.requests:
            raise InvalidRequestError("request_id", f"{seq.request_id!r} is already running")
        detok = IncrementalDetokenizer(self.tokenizer, seq.prompt_token_ids, seq.params.stop)
        self.requests[seq.request_id] = _Request(seq, detok)
        if self.history.enabled:
            seq.events.append(TimelineEvent("arrived", seq.arrival_time))
        self.scheduler.add(seq)

    def _check_lengths(self, prompt_len: int, params: SamplingParams) -> None:
        if prompt_len >= self.max_model_len:
            raise InvalidRequestError(
                "prompt",
                f"{prompt_len} tokens leave no room in the context of {self.max_model_len} tokens",
            )
        if prompt_len + params.max_tokens > self.max_model_len:
            raise InvalidRequestError(
                "max_tokens",
                f"prompt ({prompt_len}) + max_tokens ({params.max_tokens}) exceeds "
                f"the context of {self.max_model_len} tokens",
            )
        needed = self.block_manager.blocks_for(prompt_len + params.max_tokens)
        if needed > self.block_manager.num_blocks:
            raise InvalidRequestError(
                "max_tokens",
                f"the request needs {needed} KV blocks; the pool has "
                f"{self.block_manager.num_blocks} (raise kv_cache_memory)",
            )

    def abort(self, request_id: str) -> RequestOutput | None:
        """Stop a request now and free all of its blocks; None if it is unknown or done."""
        req = self.requests.get(request_id)
        if req is None:
            return None
        return self._finish(req, FinishReason.ABORT, "", [])

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def has_request(self, request_id: str) -> bool:
        return request_id in self.requests

    def request_ids(self) -> list[str]:
        """The live requests (waiting or running), as a copy."""
        return list(self.requests)

    def request_blocks(self) -> dict[str, int]:
        """Live request id -> the KV blocks it holds in either tier (for the cache manager).
        Safe from another thread: it reads a copy of the request table."""
        return {rid: len(r.seq.block_table) + len(r.seq.host_table)
                for rid, r in list(self.requests.items())}

    def kv_cache_usage(self) -> float:
        return self.block_manager.usage()

    def load(self) -> EngineLoad:
        """Running and waiting requests and KV usage: what gauges and status show."""
        return EngineLoad(len(self.scheduler.running), len(self.scheduler.waiting),
                          self.kv_cache_usage(), self._kv_pool_ram_bytes())

    def _kv_pool_ram_bytes(self) -> int:
        if self.device.type != "cpu":
            return 0
        return self.block_manager.touched_blocks() * self.bytes_per_block

    def scheduler_stats(self) -> SchedulerStats:
        """The queues in detail, for admission control (see `SchedulerStats`)."""
        return self.scheduler.stats()

    def kv_blocks_at_longest(self, seq: Sequence) -> int:
        """KV blocks `seq` (from `make_sequence`) will hold at its longest."""
        return self.scheduler.kv_blocks_at_longest(seq)

    @property
    def prefill_tokens_per_s(self) -> float | None:
        """The measured prompt throughput; None until a full enough step was seen."""
        return self.prefill_rate.tokens_per_s

    def prompt_seconds(self, tokens: int, num_decoding: int) -> float | None:
        """Expected seconds to compute `tokens` prompt tokens beside `num_decoding` decodes,
        at the measured rate and the configured latency target; None before any measurement."""
        return self.prefill_rate.seconds_for(tokens, num_decoding, self.config.itl_target_ms)

    def kv_stats(self) -> KVCacheStats:
        kv = self.block_manager.stats()
        copied = (kv.blocks_offloaded + kv.blocks_restored + kv.blocks_swapped_out
                  + kv.blocks_swapped_in)
        return KVCacheStats(**dataclasses.asdict(kv), preemptions=self.scheduler.num_preemptions,
                            swap_bytes=copied * self.bytes_per_block,
                            swap_seconds=self.swap_seconds)

    def cached_block_hashes(self) -> dict[str, list[bytes]]:
        """Tier -> hashes of the blocks a prefix hit can use there (for the cache manager)."""
        return self.block_manager.cached_hashes()

    @contextlib.contextmanager
    def warming_up(self) -> Iterator[None]:
        """Requests run inside leave no trace a user request would not: prefix caching is off
        (no block is cached, no KV event recorded, no prefix query counted) and the measured
        prompt throughput is restored afterwards, so a cold first step does not stand for this
        hardware's rate. Enter and leave it only between steps."""
        caching, rate = self.block_manager.enable_caching, self.prefill_rate.tokens_per_s
        self.block_manager.enable_caching = False
        try:
            yield
        finally:
            self.block_manager.enable_caching = caching
            self.prefill_rate.tokens_per_s = rate

    # -- the step -------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        clock = _PhaseClock(self.device, any(sync for _, sync in self._step_observers))
        budget = self.prefill_rate.token_budget(self.scheduler.num_decoding(),
                                                self.config.itl_target_ms)
        self._propose_drafts()
        propose_s = clock.lap()
        scheduled = self.scheduler.schedule(budget)
        recording = self.history.enabled or bool(self._step_observers)
        # the batch as scheduled (the update below moves every chunk's start)
        chunks = _chunk_records(scheduled) if recording else ()
        schedule_s = clock.lap()  # (the chunk records' ~1 us each are in this phase; the
        # rest of the recorder's own time is counted in history.seconds)
        self._run_copies()
        copy_s = clock.lap()
        if not scheduled.chunks:
            if scheduled.preempted and self.history.enabled:  # a step that only preempted
                _add_preemption_events(scheduled.preempted, clock.started, self.num_steps)
            return []
        start = time.perf_counter()
        inp = self.runner.prepare(scheduled.chunks)
        prepare_s = clock.lap()
        logits = self.runner.forward(inp)
        forward_s = clock.lap()
        for inspect in list(self._forward_observers):  # debuggers: off the clock's phases
            inspect(self.runner.view(inp, logits))
            clock.lap()
        seqs = [c.seq for c in inp.sampling]
        verified = sample_and_verify(logits, inp.sampling)
        sample_s = clock.lap()
        self.prefill_rate.observe(scheduled.num_tokens, time.perf_counter() - start, budget)
        # only once nothing above can fail: the scheduler applies the step, token by token,
        # with the text of each (stop strings) from the request's detokenizer
        texts = _Texts(self.requests)
        reasons = self.scheduler.update_from_output(
            scheduled, seqs, [v.token_ids for v in verified], texts.push)
        finished = [(s, r) for s, r in zip(seqs, reasons, strict=True) if r is not None]
        for seq, v in zip(seqs, verified, strict=True):
            if v.num_drafts:
                self.spec_stats.observe(v.num_drafts, v.num_accepted)
                seq.spec_len = _next_spec_len(v, self.config.num_speculative_tokens)
        phases = (propose_s, schedule_s, copy_s, prepare_s, forward_s, sample_s, clock.lap())
        for i, seconds in enumerate(phases):
            self._phase_seconds[i] += seconds
        if recording:
            record = self._record_step(clock, scheduled, chunks, finished, phases)
            self.history.append(record)
            self.history.seconds += time.perf_counter() - clock.last
        outputs = [self._output(s, v, texts, reason)
                   for s, v, reason in zip(seqs, verified, reasons, strict=True)]
        if recording:
            for observer, _ in list(self._step_observers):
                observer(record)
        self.num_steps += 1
        return outputs

    def _propose_drafts(self) -> None:
        """Speculative decoding: give each decoding request its drafts for this step (up to
        num_speculative_tokens, never past its max_tokens or the context), unless it opted out
        or more requests than speculative_disable_by_batch_size are running."""
        if self.proposer is None:
            return
        running = self.scheduler.running
        limit = self.config.speculative_disable_by_batch_size
        on = limit is None or len(running) <= limit
        k = self.config.num_speculative_tokens
        wanted: list[tuple[Sequence, int]] = []
        for seq in running:
            seq.spec_token_ids = []
            room = min(seq.params.max_tokens - len(seq.output_token_ids),
                       self.max_model_len - seq.num_tokens) - 1  # the target's own token: 1
            if on and room > 0 and seq.params.speculate and (
                    seq.num_tokens - seq.num_computed_tokens == 1):  # decoding
                wanted.append((seq, min(seq.spec_len or k, room)))
        if wanted:
            for (seq, _), drafts in zip(wanted, self.proposer.propose(wanted), strict=True):
                seq.spec_token_ids = drafts

    def observe_steps(self, observer: Callable[[StepRecord], None],
                      synchronize: bool = False) -> Callable[[], None]:
        """Call `observer` with a `StepRecord` after every step that computes something, until
        the returned function is called. `synchronize` waits for the device at each phase's
        end (on a GPU the phases are asynchronous otherwise): exact phases, a slower step.
        Profilers and timelines use this instead of wrapping the engine's parts."""
        entry = (observer, synchronize)
        self._step_observers.append(entry)
        return lambda: self._step_observers.remove(entry)

    def observe_forward(self, observer: Callable[[ForwardView], None]) -> Callable[[], None]:
        """Call `observer` with each step's `ForwardView` (the model's real input tensors, the
        KV pool and the logits) right after the forward pass, until the returned function is
        called. For debuggers (`kvserve trace --explain`); it syncs with the device."""
        self._forward_observers.append(observer)
        return lambda: self._forward_observers.remove(observer)

    def set_timeline_steps(self, n: int) -> None:
        """Resize the step recorder between steps (0: off; what it kept is dropped). The
        benchmarks turn it off and on to measure what it costs."""
        self.history = StepHistory(n)
        self.block_manager.track_activity = self.history.enabled

    def step_totals(self) -> StepTotals:
        """Steps that computed something, and the seconds of each phase, since the start."""
        return StepTotals(self.num_steps, dict(zip(PHASES, self._phase_seconds, strict=True)))

    def recent_steps(self, n: int | None = None) -> list[StepRecord]:
        """The last `n` steps the recorder kept (all of them by default), oldest first."""
        return self.history.recent(n)

    def recent_timelines(self) -> list[RequestTimeline]:
        """The timelines of the last requests that ended (timeline_steps / 8 of them)."""
        return list(self.history.timelines)

    @property
    def wall_offset(self) -> float:
        """Add to a record's perf_counter time for Unix time (exports, OpenTelemetry)."""
        return self.history.wall_offset

    def _record_step(
        self, clock: _PhaseClock, scheduled: SchedulerOutput, chunks: tuple[ChunkRecord, ...],
        finished: list[tuple[Sequence, FinishReason]],
        phases: tuple[float, ...],  # seconds of each of PHASES
    ) -> StepRecord:
        """The step's record, and each of its requests' timeline events (before the outputs
        are built: a finished request's last output carries its whole timeline)."""
        activity = self.block_manager.take_activity()
        preempted = tuple(Preemption(s.request_id, bool(s.host_table))
                          for s in scheduled.preempted)
        kv = self.block_manager
        record = StepRecord(
            self.num_steps, clock.started, chunks, *phases,
            admitted=tuple(s.request_id for s in scheduled.admitted), preempted=preempted,
            finished=tuple((s.request_id, r.value) for s, r in finished),
            blocks=tuple(activity.items()),
            num_running=len(self.scheduler.running), num_waiting=len(self.scheduler.waiting),
            kv_device_used=kv.num_blocks - kv.num_free, kv_device_cached=len(kv.cached),
            kv_host_used=kv.host.num_used if kv.host else 0)
        if self.history.enabled:
            _add_timeline_events(record, scheduled)
        return record

    def run_until_done(self) -> Iterator[RequestOutput]:
        """Step until no request is left, yielding every output as it comes: the one
        step-until-done loop (generate_all, evals, benchmarks)."""
        while self.has_unfinished():
            yield from self.step()

    def _run_copies(self) -> None:
        """The step's batched KV copies (swaps, demotions, restores), before the model runs."""
        plan = self.block_manager.take_copy_plan()
        if plan:
            start = time.perf_counter()
            self.runner.copy(plan)
            self.block_manager.copies_done(plan)
            self.swap_seconds += time.perf_counter() - start

    def _output(self, seq: Sequence, verified: Verified, texts: _Texts,
                reason: FinishReason | None) -> RequestOutput:
        """The step's output of `seq`: the tokens the scheduler kept (all new ones, or up to a
        stop); the scheduler already decided whether `seq` stopped."""
        req = self.requests[seq.request_id]
        n = texts.taken.get(seq.request_id, 0)
        tokens, lps = verified.token_ids[:n], verified.logprobs[:n]
        text = texts.text.get(seq.request_id, "")
        if reason is None:
            return RequestOutput(seq.request_id, tokens, text, lps)
        if seq.request_id in texts.hit:  # a stop string matched; it is not part of the output
            text += req.detok.stop_text
        else:
            text += req.detok.flush()
        return self._final_output(req, reason, text, lps, tokens)

    def _finish(
        self, req: _Request, reason: FinishReason, text: str, logprobs: list[TokenLogprobs],
    ) -> RequestOutput:
        self.scheduler.finish(req.seq, reason)
        if self.history.enabled:
            req.seq.events.append(TimelineEvent("finished", time.perf_counter(),
                                                step=self.num_steps, detail=reason.value))
        return self._final_output(req, reason, text, logprobs)

    def _final_output(
        self,
        req: _Request,
        reason: FinishReason,
        text: str,
        logprobs: list[TokenLogprobs],
        token_ids: list[int] | None = None,
    ) -> RequestOutput:
        seq = req.seq
        del self.requests[seq.request_id]
        if self.proposer is not None:
            self.proposer.forget(seq.request_id)
        ttft = None
        if seq.first_token_time is not None:
            ttft = (seq.first_token_time - seq.arrival_time) * 1000
        usage = Usage(seq.num_prompt_tokens, len(seq.output_token_ids), ttft,
                      seq.num_cached_prompt_tokens, seq.num_draft_tokens, seq.num_accepted_tokens)
        timeline = None
        if self.history.enabled:
            timeline = RequestTimeline(seq.request_id, tuple(seq.events),
                                       self.history.wall_offset)
            self.history.ended(timeline)
        return RequestOutput(seq.request_id, token_ids or [], text, logprobs, reason.value, usage,
                             timeline)

    # -- convenience ----------------------------------------------------------------------
    def generate_all(self, requests: list[dict[str, Any]]) -> dict[str, list[RequestOutput]]:
        """Run `add_request(**r)` for each and step until all finish (tests, benchmarks)."""
        ids = [self.add_request(**r) for r in requests]
        outputs: dict[str, list[RequestOutput]] = {i: [] for i in ids}
        for out in self.run_until_done():
            outputs[out.request_id].append(out)
        return outputs


def _as_params(params: SamplingParams | dict[str, Any] | None) -> SamplingParams:
    if params is None:
        return SamplingParams()
    if isinstance(params, dict):
        return SamplingParams.from_dict(params)
    if not isinstance(params, SamplingParams):
        raise InvalidRequestError("params", f"must be SamplingParams or a dict, not {params!r}")
    return params


class _Texts:
    """The text of one step's new tokens, request by request, from each request's detokenizer
    (the scheduler pushes the tokens it keeps, in order, and stops a request on a hit)."""

    def __init__(self, requests: dict[str, _Request]) -> None:
        self.requests = requests
        self.text: dict[str, str] = {}
        self.taken: dict[str, int] = {}  # tokens pushed (the ones the output carries)
        self.hit: set[str] = set()  # requests whose text reached a stop string

    def push(self, seq: Sequence, token: int) -> bool:
        rid = seq.request_id
        self.taken[rid] = self.taken.get(rid, 0) + 1
        piece = self.requests[rid].detok.push(token)
        if piece is None:
            self.hit.add(rid)
            return True
        self.text[rid] = self.text.get(rid, "") + piece
        return False


class _PhaseClock:
    """Laps of one step's phases; with `synchronize`, each lap first waits for the device."""

    def __init__(self, device: torch.device, synchronize: bool) -> None:
        self.sync = synchronize and device.type == "cuda"
        self.device = device
        self.started = self.last = time.perf_counter()

    def lap(self) -> float:
        if self.sync:
            torch.cuda.synchronize(self.device)
        now = time.perf_counter()
        seconds, self.last = now - self.last, now
        return seconds


def _chunk_records(scheduled: SchedulerOutput) -> tuple[ChunkRecord, ...]:
    return tuple(ChunkRecord(c.seq.request_id, c.start, c.num_tokens, c.samples,
                             len(c.drafts))
                 for c in scheduled.chunks)


def _add_timeline_events(record: StepRecord, scheduled: SchedulerOutput) -> None:
    """Append the step's events (`timeline.step_events`) to its requests' timelines."""
    seqs = {s.request_id: s for s in (*scheduled.preempted, *scheduled.admitted,
                                      *(c.seq for c in scheduled.chunks))}
    first_tokens = {chunk.seq.request_id: chunk.seq.first_token_time  # (the record's chunks:
                    for chunk, c in zip(scheduled.chunks, record.chunks, strict=True)  # as run)
                    if c.samples and len(chunk.seq.output_token_ids) == 1}
    events = step_events(
        record, resumed={s.request_id for s in scheduled.admitted if s.num_preemptions},
        cached_tokens={s.request_id: s.num_cached_prompt_tokens for s in scheduled.admitted},
        first_tokens={rid: t for rid, t in first_tokens.items() if t is not None})
    for rid, event in events:
        seqs[rid].events.append(event)


def _next_spec_len(verified: Verified, most: int) -> int:
    """A request's next draft length, Hugging Face's heuristic schedule: two more after a
    step that accepted every draft, one fewer after a rejection (within 1..most). Where drafts
    keep failing (open-ended chat) a verifying step then costs one extra row, not `most`."""
    if verified.num_accepted == verified.num_drafts:
        return min(most, verified.num_drafts + 2)
    return max(1, verified.num_drafts - 1)


def _add_preemption_events(preempted: list[Sequence], start: float, step: int) -> None:
    """A step that only preempted (nothing left to compute): no record, the events alone."""
    seqs = {s.request_id: s for s in preempted}
    for rid, event in preemption_events(
            [Preemption(s.request_id, bool(s.host_table)) for s in preempted], start, step,
            {s.request_id: len(s.host_table) for s in preempted}):
        seqs[rid].events.append(event)


def _salt(tenant: str, rope_key: str) -> str:
    """A block hash's salt: the tenant's, and what the request's RoPE rotations depend on
    beyond its tokens (a long prompt's length under dynamic NTK, `RotaryEmbedding.cache_key`).
    The router hashes prompts with the tenant's salt alone, so such prompts route on load."""
    return f"{tenant}\0{rope_key}" if rope_key else tenant


def _max_model_len(config: EngineConfig, hf_config) -> int:
    length = config.max_model_len or hf_config.max_position_embeddings
    # sliding-window attention is not implemented: stay within the window, where it is exact
    window = getattr(hf_config, "sliding_window", None)
    if window and getattr(hf_config, "use_sliding_window", True):
        length = min(length, window)
    return length


def _resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def _resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, not {name!r}")
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, name)


def _resolve_block_size(block_size: int | None, backend: PagedAttention,
                        dtype: torch.dtype) -> int:
    """What the backend's kernels accept: flash_attn's paged cache needs a multiple of its
    provider's page size (256), and bf16/fp16. Checked here, so a wrong setting stops the
    engine (and a replica's start) instead of its first request."""
    multiple = getattr(backend, "block_multiple", 1)
    dtypes = getattr(getattr(backend, "provider", None), "dtypes", None)
    if dtypes is not None and dtype not in dtypes:
        names = ", ".join(str(d).removeprefix("torch.") for d in dtypes)
        raise ValueError(f"attention_backend {backend.name} ({backend.kernel_name}) runs "
                         f"{names}, not dtype {str(dtype).removeprefix('torch.')}")
    block_size = block_size or (multiple if multiple > 1 else 16)
    if block_size % multiple:
        raise ValueError(f"attention_backend {backend.name} ({backend.kernel_name}) needs "
                         f"block_size a multiple of {multiple}, not {block_size}")
    return block_size


def _cpu_kernels(device: torch.device, dtype: torch.dtype) -> CpuKernels | None:
    """kvserve's C++ kernels where they apply (fp32 and bf16 on a CPU), built at first use.
    fp16 runs torch's ops and oneDNN: CPUs have no fp16 arithmetic worth a kernel of its own."""
    if device.type != "cpu" or dtype not in (torch.float32, torch.bfloat16):
        return None
    return load_cpu_kernels()


def _build_model(
    ckpt, device: torch.device, dtype: torch.dtype, cpu_kernels: CpuKernels | None,
    triton: bool = False,
) -> CausalLM:
    """The model in `dtype` on `device`; `triton`: with its Triton kernels (the triton
    attention backend's model, `CausalLM.use_triton_kernels`)."""
    key = (device, dtype, cpu_kernels is not None, triton)
    if key in ckpt.models:  # another engine in this process built it from these tensors
        return ckpt.models[key]
    with torch.device("meta"):
        model = CausalLM(ckpt.config)
    model = model.to_empty(device=device).to(dtype)
    if ckpt.config.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    model.load_checkpoint(dict(ckpt.tensors))
    if triton:
        model.use_triton_kernels()
    elif cpu_kernels is not None:
        model.use_cpu_kernels(cpu_kernels)
    if device.type == "cpu" and onednn_available(dtype):
        model.use_onednn_matmuls()
    ckpt.models[key] = model = model.eval()
    return model


def _kv_spec(config, block_size: int, dtype: torch.dtype) -> KVCacheSpec:
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return KVCacheSpec(
        config.num_hidden_layers, config.num_key_value_heads, head_dim, block_size, dtype
    )


def _kv_budget(config: EngineConfig, device: torch.device, graph_bytes: int = 0) -> int:
    """The KV pool's bytes: kv_cache_memory as given, else (CUDA) the device's share less what
    is in use, an activation reserve and what the decode graphs will take (`graph_bytes`)."""
    if config.kv_cache_memory is not None:
        return config.kv_cache_memory
    if device.type != "cuda":
        return config.cpu_kv_cache_memory
    free, total = torch.cuda.mem_get_info(device)
    used = total - free
    # leave room for activations of a full step: a quarter of what the weights take, at least 1 GiB
    reserve = max(1024**3, torch.cuda.memory_allocated(device) // 4)
    return max(0, int(total * config.gpu_memory_utilization) - used - reserve - graph_bytes)


def _uses_graphs(config: EngineConfig, device: torch.device, backend: PagedAttention) -> bool:
    """Decode steps replay CUDA graphs: on CUDA, unless enforce_eager, with a backend whose
    launches depend on the batch size alone (triton)."""
    return (device.type == "cuda" and not config.enforce_eager
            and getattr(backend, "supports_cuda_graphs", False))


def _graph_bytes(config: EngineConfig, hf_config, spec: KVCacheSpec, max_model_len: int) -> int:
    """`cuda_graphs.graph_memory_bytes` for this model at max_num_seqs rows."""
    return graph_memory_bytes(
        config.max_num_seqs, -(-max_model_len // spec.block_size), hf_config.hidden_size,
        hf_config.num_attention_heads, spec.num_kv_heads, spec.head_dim,
        hf_config.intermediate_size, spec.dtype)


def _eos_ids(ckpt) -> set[int]:
    ids: set[int] = set()
    gen_path = ckpt.path / "generation_config.json"
    if gen_path.exists():
        eos = json.loads(gen_path.read_text()).get("eos_token_id")
        ids |= set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    if ckpt.tokenizer.eos_token_id is not None:
        ids.add(ckpt.tokenizer.eos_token_id)
    return ids
