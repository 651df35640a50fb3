"""The synchronous engine core: requests in, one scheduled model step at a time, outputs out.

`step` is nano-vllm's loop in three parts: schedule (the scheduler picks the chunks, drafts
and KV copies included), execute (the model runner computes them, the sampler picks tokens)
and update (the scheduler's `update_from_output` appends them, runs the stop checks and frees
finished requests; the output processor turns them into text and outputs). Everything else has
a module of its own: building the parts (`builder`), checking and tokenizing input
(`input_processor`), text and outputs (`output_processor`), and recording steps
(`step_recorder`).

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
import time
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

from kvserve.workers.builder import ModelInfo, Proposer, build_engine_parts
from kvserve.workers.config import EngineConfig
from kvserve.workers.core.block_manager import held
from kvserve.workers.core.outputs import (
    KVCacheStats,
    RequestOutput,
    SchedulerStats,
    SpecDecodeStats,
)
from kvserve.workers.core.prefill_rate import PrefillRate
from kvserve.workers.core.sampling_params import SamplingParams
from kvserve.workers.core.scheduler import SchedulerOutput
from kvserve.workers.core.sequence import FinishReason, Sequence
from kvserve.workers.core.timeline import (
    ChunkRecord,
    RequestTimeline,
    StepHistory,
    StepRecord,
    StepTotals,
)
from kvserve.workers.input_processor import InputProcessor, as_params
from kvserve.workers.model_executor.attention import PagedAttention
from kvserve.workers.model_executor.loader import LoadedCheckpoint
from kvserve.workers.model_executor.model_runner import ForwardView
from kvserve.workers.model_executor.rejection_sampler import Verified, sample_and_verify
from kvserve.workers.output_processor import OutputProcessor
from kvserve.workers.parallel.ranks import RankLauncher
from kvserve.workers.step_recorder import PhaseClock, StepRecorder
from kvserve.workers.structured_output import StructuredOutputManager

__all__ = ["EngineLoad", "LLMEngine", "ModelInfo", "Proposer"]


class EngineLoad(NamedTuple):
    """What gauges and the status rows show. Lengths and one ratio: cheap, and safe to read
    from another thread while a step runs."""

    running: int
    waiting: int
    kv_cache_usage: float  # 0-1
    # the KV pools' pages in this process's RAM: on CPU they are committed as blocks are first
    # written, so the pool's share of a replica's RSS grows to its configured size, and a soak
    # that watches RSS for leaks takes it out (kvserve/cluster/memory_watch.py); 0 for a GPU
    # pool (the pinned host tier of a GPU engine is committed whole at start)
    kv_pool_ram_bytes: int = 0


class LLMEngine:
    def __init__(
        self, config: EngineConfig | None = None, checkpoint: LoadedCheckpoint | None = None,
        draft_checkpoint: LoadedCheckpoint | None = None,
        rank_launcher: RankLauncher | None = None,
    ) -> None:
        """`checkpoint` (e.g. `tiny.tiny_checkpoint()`) replaces loading `config.model`, and
        `draft_checkpoint` loading `config.draft_model` (speculative_method draft_model);
        `rank_launcher` starts tensor-parallel ranks 1..N-1 (default: local processes)."""
        self.config = config = config or EngineConfig()
        parts = build_engine_parts(config, checkpoint, draft_checkpoint, rank_launcher)
        ckpt = parts.checkpoint
        self.hf_config, self.tokenizer, self.model_path = ckpt.config, ckpt.tokenizer, ckpt.path
        self.vocab_size = ckpt.config.vocab_size
        self.device, self.dtype, self.max_model_len = parts.device, parts.dtype, parts.max_model_len
        self.runner, self.proposer = parts.runner, parts.proposer
        self.followers = parts.followers  # the other tensor-parallel ranks, if any
        self.model = parts.runner.model
        self.block_manager, self.scheduler = parts.block_manager, parts.scheduler
        self.kv_events = parts.kv_events  # the cluster turns it on to report to its cache manager
        self.eos_token_ids = parts.eos_token_ids
        self.bytes_per_block = parts.bytes_per_block
        self._info = parts.info
        self.swap_seconds = 0.0  # time spent in KV copies between device and host
        self.num_steps = 0
        self.prefill_rate = PrefillRate(config.max_num_batched_tokens)
        self.spec_stats = SpecDecodeStats()
        self.recorder = StepRecorder(config.timeline_steps, self.block_manager, self.scheduler)
        self.structured = StructuredOutputManager(self.tokenizer, self.vocab_size,
                                                  self.eos_token_ids, kernels=parts.cpu_kernels)
        self.input_processor = InputProcessor(self.tokenizer, self.vocab_size, self.max_model_len,
                                              self.block_manager, self.runner.rope,
                                              self.structured)
        self.output_processor = OutputProcessor(self.tokenizer, self.recorder,
                                               self.proposer.forget if self.proposer else None)
        self.requests = self.output_processor.requests  # live request id -> RequestState

    @property
    def info(self) -> ModelInfo:
        return self._info

    def rank_pids(self) -> list[int]:
        """The processes of tensor-parallel ranks 1..N-1 (none without tp)."""
        return self.followers.pids() if self.followers else []

    def shutdown(self) -> None:
        """Stop the tensor-parallel ranks, if any (their processes end). Idempotent; the engine
        cannot step afterwards. An engine without tp holds nothing to stop."""
        if self.followers is not None:
            self.followers.close()

    @property
    def history(self) -> StepHistory:
        """The step recorder's history (recent steps and timelines)."""
        return self.recorder.history

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

    def make_sequence(self, **request: Any) -> Sequence:
        """Validation only (`InputProcessor.make_sequence`): builds the sequence without
        touching the engine's state."""
        return self.input_processor.make_sequence(**request)

    def compile_grammar(self, params: SamplingParams | dict[str, Any] | None) -> None:
        """Compile a request's structured-output constraint into the grammar cache ahead of
        `make_sequence` (the async engine calls it on a worker thread, so a long compile holds
        up neither the step loop nor its event loop); a no-op for an unconstrained request.
        Raises InvalidRequestError as `make_sequence` would."""
        spec = as_params(params).structured_outputs
        if spec is not None:
            spec.validate()
            self.structured.compile(spec)

    def tokenize(self, **prompt: Any) -> list[int]:
        """The token ids a request with this input would get (the Tokenize RPC)."""
        return self.input_processor.tokenize(**prompt)

    def detokenize(self, token_ids: list[int]) -> str:
        return self.input_processor.detokenize(token_ids)

    def token_texts(self, token_ids: list[int]) -> list[str]:
        return self.input_processor.token_texts(token_ids)

    def enqueue(self, seq: Sequence) -> None:
        """Queue a sequence from `make_sequence`."""
        self.output_processor.add(seq)
        self.recorder.arrived(seq)
        self.scheduler.add(seq)

    def abort(self, request_id: str) -> RequestOutput | None:
        """Stop a request now and free all of its blocks; None if it is unknown or done."""
        req = self.requests.get(request_id)
        if req is None:
            return None
        self.scheduler.finish(req.seq, FinishReason.ABORT)
        self.recorder.finished(req.seq, self.num_steps, FinishReason.ABORT)
        return self.output_processor.final_output(req.seq, FinishReason.ABORT, "", [])

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
        return {rid: held(r.seq.block_table) + held(r.seq.host_table)
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
        """One step: schedule -> execute -> update. Returns the step's outputs."""
        clock = self.recorder.clock(self.device)
        laps: list[float] = []  # seconds of each of PHASES, as they end
        scheduled, chunks, budget = self._schedule(clock, laps)
        if not scheduled.chunks:
            self.recorder.preempted_only(scheduled, clock, self.num_steps)
            return []
        seqs, verified = self._execute(scheduled, budget, clock, laps)
        return self._update(scheduled, chunks, seqs, verified, clock, laps)

    def _schedule(self, clock: PhaseClock, laps: list[float],
                  ) -> tuple[SchedulerOutput, tuple[ChunkRecord, ...], int]:
        """Drafts for the decoding requests, the scheduler's batch within the prefill token
        budget (and its record, if recording: the update moves every chunk's start), and the
        KV copies it needs, done before the model runs."""
        budget = self.prefill_rate.token_budget(self.scheduler.num_decoding(),
                                                self.config.itl_target_ms)
        self._propose_drafts()
        laps.append(clock.lap())  # propose
        scheduled = self.scheduler.schedule(budget)
        chunks = self.recorder.chunks(scheduled)
        laps.append(clock.lap())  # schedule
        self._run_copies()
        laps.append(clock.lap())  # copy
        return scheduled, chunks, budget

    def _execute(self, scheduled: SchedulerOutput, budget: int, clock: PhaseClock,
                 laps: list[float]) -> tuple[list[Sequence], list[Verified]]:
        """The model's forward pass over the batch and the sampled (and verified) tokens of
        each sequence that samples."""
        start = time.perf_counter()
        inp = self.runner.prepare(scheduled.chunks)
        laps.append(clock.lap())  # prepare
        logits = self.runner.forward(inp)
        laps.append(clock.lap())  # forward
        for inspect in list(self.recorder.forward_observers):  # debuggers: off the phases
            inspect(self.runner.view(inp, logits))
            clock.lap()
        self.structured.apply(logits, inp.sampling)  # constrained rows: allowed tokens only
        verified = sample_and_verify(logits, inp.sampling)
        laps.append(clock.lap())  # sample
        self.prefill_rate.observe(scheduled.num_tokens, time.perf_counter() - start, budget)
        return [c.seq for c in inp.sampling], verified

    def _update(self, scheduled: SchedulerOutput, chunks: tuple[ChunkRecord, ...],
                seqs: list[Sequence], verified: list[Verified], clock: PhaseClock,
                laps: list[float]) -> list[RequestOutput]:
        """Only once nothing above can fail: the scheduler applies the step token by token
        (stop checks on each token's text, from the request's detokenizer), the step is
        recorded, and the outputs are built."""
        texts = self.output_processor.step_texts()
        tokens = [v.token_ids for v in verified]
        reasons = self.scheduler.update_from_output(scheduled, seqs, tokens, texts.push)
        self.structured.accept(seqs, tokens, texts.taken)
        for seq, v in zip(seqs, verified, strict=True):
            if v.num_drafts:
                self.spec_stats.observe(v.num_drafts, v.num_accepted)
                seq.spec_len = _next_spec_len(v, self.config.num_speculative_tokens)
        laps.append(clock.lap())  # detokenize
        finished = [(s, r) for s, r in zip(seqs, reasons, strict=True) if r is not None]
        record = self.recorder.record(self.num_steps, clock, scheduled, chunks, finished,
                                      tuple(laps))
        outputs = self.output_processor.outputs(seqs, verified, texts, reasons)
        self.recorder.publish(record)
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
            if on and room > 0 and seq.params.speculate and seq.grammar is None and (
                    seq.num_tokens - seq.num_computed_tokens == 1):  # decoding
                wanted.append((seq, min(seq.spec_len or k, room)))
        if wanted:
            for (seq, _), drafts in zip(wanted, self.proposer.propose(wanted), strict=True):
                seq.spec_token_ids = drafts

    def _run_copies(self) -> None:
        """The step's batched KV copies (swaps, demotions, restores), before the model runs."""
        plan = self.block_manager.take_copy_plan()
        if plan:
            start = time.perf_counter()
            self.runner.copy(plan)
            self.block_manager.copies_done(plan)
            self.swap_seconds += time.perf_counter() - start

    # -- watching steps ---------------------------------------------------------------------
    def observe_steps(self, observer: Callable[[StepRecord], None],
                      synchronize: bool = False) -> Callable[[], None]:
        """Call `observer` with a `StepRecord` after every step that computes something, until
        the returned function is called. `synchronize` waits for the device at each phase's
        end (on a GPU the phases are asynchronous otherwise): exact phases, a slower step.
        Profilers and timelines use this instead of wrapping the engine's parts."""
        return self.recorder.observe_steps(observer, synchronize)

    def observe_forward(self, observer: Callable[[ForwardView], None]) -> Callable[[], None]:
        """Call `observer` with each step's `ForwardView` (the model's real input tensors, the
        KV pool and the logits) right after the forward pass, until the returned function is
        called. For debuggers (`kvserve trace --explain`); it syncs with the device."""
        return self.recorder.observe_forward(observer)

    def set_timeline_steps(self, n: int) -> None:
        """Resize the step recorder between steps (0: off; what it kept is dropped). The
        benchmarks turn it off and on to measure what it costs."""
        self.recorder.resize(n)

    def step_totals(self) -> StepTotals:
        """Steps that computed something, and the seconds of each phase, since the start."""
        return self.recorder.totals(self.num_steps)

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

    # -- convenience ----------------------------------------------------------------------
    def run_until_done(self) -> Iterator[RequestOutput]:
        """Step until no request is left, yielding every output as it comes: the one
        step-until-done loop (generate_all, evals, benchmarks)."""
        while self.has_unfinished():
            yield from self.step()

    def generate_all(self, requests: list[dict[str, Any]]) -> dict[str, list[RequestOutput]]:
        """Run `add_request(**r)` for each and step until all finish (tests, benchmarks)."""
        ids = [self.add_request(**r) for r in requests]
        outputs: dict[str, list[RequestOutput]] = {i: [] for i in ids}
        for out in self.run_until_done():
            outputs[out.request_id].append(out)
        return outputs


def _next_spec_len(verified: Verified, most: int) -> int:
    """A request's next draft length, Hugging Face's heuristic schedule: two more after a
    step that accepted every draft, one fewer after a rejection (within 1..most). Where drafts
    keep failing (open-ended chat) a verifying step then costs one extra row, not `most`."""
    if verified.num_accepted == verified.num_drafts:
        return min(most, verified.num_drafts + 2)
    return max(1, verified.num_drafts - 1)
