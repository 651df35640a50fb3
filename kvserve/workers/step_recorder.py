"""What each step did, on one time axis: phase times, the batch, KV blocks, and the events of
every request in it.

Why apart from the engine: recording is optional and must cost nothing when off, and the
engine's step should read as schedule -> execute -> update, not as bookkeeping. The recorder
owns the step history (`StepHistory`), the phase totals every benchmark reads, and the
observers profilers and debuggers attach; the engine hands it the step's facts.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from kvserve.workers.core.block_manager import BlockManager, held
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
    events_by_request,
    preemption_events,
)
from kvserve.workers.model_executor.model_runner import ForwardView


class PhaseClock:
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


class StepRecorder:
    """The engine's step history, phase totals and observers."""

    def __init__(self, timeline_steps: int, block_manager: BlockManager,
                 scheduler: Scheduler) -> None:
        self.block_manager = block_manager  # read: block activity and pool counts
        self.scheduler = scheduler  # read: queue lengths
        self.phase_seconds = [0.0] * len(PHASES)  # since start, recording on or off
        self.step_observers: list[tuple[Callable[[StepRecord], None], bool]] = []
        self.forward_observers: list[Callable[[ForwardView], None]] = []
        self.resize(timeline_steps)

    def resize(self, timeline_steps: int) -> None:
        """Keep the last `timeline_steps` steps (0: off; what was kept is dropped)."""
        self.history = StepHistory(timeline_steps)
        self.block_manager.track_activity = self.history.enabled

    @property
    def timelines_on(self) -> bool:
        """Requests collect timeline events (the history keeps steps)."""
        return self.history.enabled

    @property
    def recording(self) -> bool:
        """Steps are recorded: for the history or for an observer."""
        return self.history.enabled or bool(self.step_observers)

    def clock(self, device: torch.device) -> PhaseClock:
        """A step's clock; it waits for the device at each lap if an observer asked to."""
        return PhaseClock(device, any(sync for _, sync in self.step_observers))

    def observe_steps(self, observer: Callable[[StepRecord], None],
                      synchronize: bool = False) -> Callable[[], None]:
        entry = (observer, synchronize)
        self.step_observers.append(entry)
        return lambda: self.step_observers.remove(entry)

    def observe_forward(self, observer: Callable[[ForwardView], None]) -> Callable[[], None]:
        self.forward_observers.append(observer)
        return lambda: self.forward_observers.remove(observer)

    def chunks(self, scheduled: SchedulerOutput) -> tuple[ChunkRecord, ...]:
        """The batch as scheduled (the update moves every chunk's start), if recording."""
        if not self.recording:
            return ()
        return tuple(ChunkRecord(c.seq.request_id, c.start, c.num_tokens, c.samples,
                                 len(c.drafts))
                     for c in scheduled.chunks)

    def arrived(self, seq: Sequence) -> None:
        if self.timelines_on:
            seq.events.append(TimelineEvent("arrived", seq.arrival_time))

    def finished(self, seq: Sequence, step: int, reason: FinishReason) -> None:
        """A request ended outside a step (an abort)."""
        if self.timelines_on:
            seq.events.append(TimelineEvent("finished", time.perf_counter(), step=step,
                                            detail=reason.value))

    def preempted_only(self, scheduled: SchedulerOutput, clock: PhaseClock, step: int) -> None:
        """A step that only preempted (nothing left to compute): no record, the events alone."""
        if not (scheduled.preempted and self.timelines_on):
            return
        seqs = {s.request_id: s for s in scheduled.preempted}
        for rid, event in preemption_events(
                [Preemption(s.request_id, bool(s.host_table)) for s in scheduled.preempted],
                clock.started, step, {s.request_id: held(s.host_table) for s in seqs.values()}):
            seqs[rid].events.append(event)

    def record(self, index: int, clock: PhaseClock, scheduled: SchedulerOutput,
               chunks: tuple[ChunkRecord, ...], finished: list[tuple[Sequence, FinishReason]],
               phases: tuple[float, ...]) -> StepRecord | None:
        """Count the step's phase seconds (`phases`, one per PHASES); if recording, its
        record, kept, and its requests' timeline events (before the outputs are built: a
        finished request's last output carries its whole timeline)."""
        for i, seconds in enumerate(phases):
            self.phase_seconds[i] += seconds
        if not self.recording:
            return None
        kv = self.block_manager
        record = StepRecord(
            index, clock.started, chunks, *phases,
            admitted=tuple(s.request_id for s in scheduled.admitted),
            preempted=tuple(Preemption(s.request_id, bool(s.host_table))
                            for s in scheduled.preempted),
            finished=tuple((s.request_id, r.value) for s, r in finished),
            blocks=tuple(kv.take_activity().items()),
            num_running=len(self.scheduler.running), num_waiting=len(self.scheduler.waiting),
            kv_device_used=kv.num_blocks - kv.num_free, kv_device_cached=len(kv.cached),
            kv_host_used=kv.host.num_used if kv.host else 0)
        if self.timelines_on:
            _add_request_events(record, scheduled)
        self.history.append(record)
        self.history.seconds += time.perf_counter() - clock.last
        return record

    def publish(self, record: StepRecord | None) -> None:
        """Hand the step's record to the observers (after its outputs are built)."""
        if record is not None:
            for observer, _ in list(self.step_observers):
                observer(record)

    def timeline(self, seq: Sequence) -> RequestTimeline | None:
        """An ending request's timeline, kept among the recent ones; None when off."""
        if not self.timelines_on:
            return None
        timeline = RequestTimeline(seq.request_id, tuple(seq.events), self.history.wall_offset)
        self.history.ended(timeline)
        return timeline

    def totals(self, num_steps: int) -> StepTotals:
        return StepTotals(num_steps, dict(zip(PHASES, self.phase_seconds, strict=True)))


def _add_request_events(record: StepRecord, scheduled: SchedulerOutput) -> None:
    """Append the step's events (`timeline.events_by_request`) to its requests' timelines,
    with what only the engine knows: who resumes, prefix hits and first-token times."""
    seqs = {s.request_id: s for s in (*scheduled.preempted, *scheduled.admitted,
                                      *(c.seq for c in scheduled.chunks))}
    first_tokens = {chunk.seq.request_id: chunk.seq.first_token_time  # (the record's chunks:
                    for chunk, c in zip(scheduled.chunks, record.chunks, strict=True)  # as run)
                    if c.samples and len(chunk.seq.output_token_ids) == 1}
    events = events_by_request(
        [record], resumed={s.request_id for s in scheduled.admitted if s.num_preemptions},
        cached_tokens={s.request_id: s.num_cached_prompt_tokens for s in scheduled.admitted},
        first_tokens={rid: t for rid, t in first_tokens.items() if t is not None})
    for rid, evs in events.items():
        seqs[rid].events.extend(evs)
