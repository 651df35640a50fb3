"""Generation on a time axis: what each engine step did, and each request's life, step by step.

The design kvserve comes from puts time first: generation is a sequence of steps t = 0..n, and
at each one some requests share the batch, some prompt chunk is prefilled, someone is preempted
or swapped. The engine records exactly that, on by default and bounded:

- a `StepRecord` per step that computes something, kept in a ring buffer (`StepHistory`): the
  scheduled chunks (request, phase, token positions a:b), the time of each phase, the KV blocks
  each request gained and lost (allocated, freed, prefix hits, demotions, restores, swaps),
  preemptions, admissions, finishes, the queues and KV usage of both tiers after the step;
- a `TimelineEvent` list per request (arrived, admitted, each prefill chunk, first token, each
  decode with its batch size, preempted, swapped out and in, resumed, finished), handed back on
  its last output as a `RequestTimeline`.

Times are `time.perf_counter()` seconds; `StepHistory.wall_offset` turns them into Unix time
for exports (Chrome traces, OpenTelemetry). Plain data only: exporters live above the engine.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Container, Iterable, Mapping
from dataclasses import dataclass, field, fields

# a step's phases, in order (StepRecord's `<phase>_s` fields)
PHASES = ("propose", "schedule", "copy", "prepare", "forward", "sample", "detokenize")


@dataclass(frozen=True)
class StepTotals:
    """Steps run and seconds per phase since the engine started, recorder on or off (the
    replica's step-time metrics)."""

    steps: int
    seconds: dict[str, float]  # phase -> seconds


@dataclass(frozen=True, slots=True)
class ChunkRecord:
    """One request's share of a step: tokens [start, start + num_tokens) computed."""

    request_id: str
    start: int  # first token position computed
    num_tokens: int
    samples: bool  # the chunk reached the request's last token, so it sampled one
    drafts: int = 0  # speculative draft tokens among them, verified by this step

    @property
    def is_decode(self) -> bool:
        """One token with context before it, and any drafts after it: a decode (otherwise a
        prefill chunk, or the recompute of a preempted request)."""
        return self.num_tokens == 1 + self.drafts and self.start > 0

    @property
    def phase(self) -> str:
        return "decode" if self.is_decode else "prefill"

    @property
    def end(self) -> int:
        return self.start + self.num_tokens


@dataclass(slots=True)
class BlockActivity:
    """KV blocks one request gained and lost in one step (the KV manager counts them)."""

    allocated: int = 0  # new device blocks for its tokens
    freed: int = 0  # device and host blocks released (finish, abort, preemption)
    hit: int = 0  # blocks taken from the prefix cache at admission (either tier)
    restored: int = 0  # host-tier hits copied back to the device for it
    demoted: int = 0  # cached blocks its allocations evicted and copied to the host tier
    evicted: int = 0  # cached blocks its allocations reclaimed (demoted or dropped)
    swapped_out: int = 0  # its blocks copied to the host tier at preemption
    swapped_in: int = 0  # and copied back at resume

    def __bool__(self) -> bool:
        return any(getattr(self, f.name) for f in fields(self))

    def as_dict(self) -> dict[str, int]:
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name)}


@dataclass(frozen=True, slots=True)
class Preemption:
    request_id: str
    swapped: bool  # its KV went to the host tier (else it is recomputed on resume)


@dataclass(frozen=True)
class StepRecord:
    """One engine step: what ran, each phase's time, the KV traffic, the queues after it.

    Kept in the engine's `StepHistory` and given to `LLMEngine.observe_steps` observers after
    the step. The phases are consecutive, so they add up to the step (with synchronization on
    a GPU when an observer asked for it)."""

    index: int  # steps run by this engine before this one
    start: float  # time.perf_counter() when the step began
    chunks: tuple[ChunkRecord, ...]  # the batch, in schedule order
    propose_s: float  # speculative decoding's drafts (a draft model's passes); 0 without it
    schedule_s: float
    copy_s: float  # KV swaps, demotions and restores between device and host
    prepare_s: float  # the step's tensors, one host->device copy
    forward_s: float  # the model and the logits
    sample_s: float  # sampling the next tokens
    detokenize_s: float  # text, stop checks, the scheduler's update, outputs
    admitted: tuple[str, ...] = ()  # requests that left the queue this step (new or resumed)
    preempted: tuple[Preemption, ...] = ()
    finished: tuple[tuple[str, str], ...] = ()  # (request id, finish reason)
    blocks: tuple[tuple[str, BlockActivity], ...] = ()  # per request, since the last record
    num_running: int = 0  # after the step
    num_waiting: int = 0
    kv_device_used: int = 0  # device blocks held by requests, after the step
    kv_device_cached: int = 0  # unreferenced, kept for prefix hits
    kv_host_used: int = 0  # host-tier blocks in use (cached and swapped)

    @property
    def seconds(self) -> float:
        return (self.propose_s + self.schedule_s + self.copy_s + self.prepare_s + self.forward_s
                + self.sample_s + self.detokenize_s)

    @property
    def end(self) -> float:
        return self.start + self.seconds

    @property
    def num_tokens(self) -> int:
        """Tokens computed: prefill chunks' and decodes'."""
        return sum(c.num_tokens for c in self.chunks)

    @property
    def num_decodes(self) -> int:
        return sum(c.is_decode for c in self.chunks)

    @property
    def num_prefill_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks if not c.is_decode)

    @property
    def num_sampled(self) -> int:
        """Rows that sampled a token (chunks that reached their request's end)."""
        return sum(c.samples for c in self.chunks)

    @property
    def request_ids(self) -> tuple[str, ...]:
        return tuple(c.request_id for c in self.chunks)

    @property
    def batch_size(self) -> int:
        return len(self.chunks)

    def as_dict(self, wall_offset: float = 0.0) -> dict:
        """JSON-ready (a line of `kvserve trace`'s steps.jsonl), times in Unix seconds."""
        return {
            "index": self.index, "time": self.start + wall_offset, "seconds": self.seconds,
            "chunks": [{"request_id": c.request_id, "phase": c.phase, "start": c.start,
                        "num_tokens": c.num_tokens} for c in self.chunks],
            "phases_s": {p: getattr(self, f"{p}_s") for p in PHASES},
            "admitted": list(self.admitted),
            "preempted": [{"request_id": p.request_id, "swapped": p.swapped}
                          for p in self.preempted],
            "finished": [{"request_id": r, "reason": why} for r, why in self.finished],
            "kv_blocks": {rid: a.as_dict() for rid, a in self.blocks},
            "num_running": self.num_running, "num_waiting": self.num_waiting,
            "kv_device_used": self.kv_device_used, "kv_device_cached": self.kv_device_cached,
            "kv_host_used": self.kv_host_used,
        }


# the kinds of TimelineEvent, in the order a request meets them
EVENT_KINDS = ("arrived", "admitted", "prefill", "first_token", "decode", "preempted",
               "swapped_out", "swapped_in", "resumed", "finished")


@dataclass(frozen=True, slots=True)
class TimelineEvent:
    """One thing that happened to a request. `start`/`end` are perf_counter seconds (`end`
    only for work that took time: prefill chunks and decodes); `step` is the engine step."""

    kind: str  # one of EVENT_KINDS
    start: float
    end: float | None = None
    step: int | None = None
    first: int | None = None  # prefill/decode: first token position computed
    num_tokens: int = 0  # prefill/decode: tokens computed; admitted: prompt tokens hit
    batch_size: int = 0  # prefill/decode: requests in that step
    blocks: int = 0  # swapped_out/swapped_in: KV blocks copied
    detail: str = ""  # preempted: "swap" | "recompute"; finished: the finish reason


@dataclass(frozen=True)
class RequestTimeline:
    """A request's life, event by event (on its last `RequestOutput` as `.timeline`)."""

    request_id: str
    events: tuple[TimelineEvent, ...]
    wall_offset: float  # add to a perf_counter time for Unix time

    def of_kind(self, kind: str) -> list[TimelineEvent]:
        return [e for e in self.events if e.kind == kind]

    def as_dict(self) -> dict:
        """JSON-ready: Unix times, empty fields left out."""
        out = []
        for e in self.events:
            d = {"kind": e.kind, "time": e.start + self.wall_offset}
            if e.end is not None:
                d["duration_s"] = e.end - e.start
            for name in ("step", "first", "num_tokens", "batch_size", "blocks", "detail"):
                value = getattr(e, name)
                if value not in (None, 0, ""):
                    d[name] = value
            out.append(d)
        return {"request_id": self.request_id, "events": out}


def preemption_events(preempted: Iterable[Preemption], start: float, step: int,
                      swapped_out: Mapping[str, int]) -> list[tuple[str, TimelineEvent]]:
    """(request id, event) for each preemption, and its swap-out (`swapped_out`: blocks copied
    to the host per request) where its KV went to the host tier."""
    out: list[tuple[str, TimelineEvent]] = []
    for p in preempted:
        out.append((p.request_id, TimelineEvent(
            "preempted", start, step=step, detail="swap" if p.swapped else "recompute")))
        if p.swapped:
            out.append((p.request_id, TimelineEvent(
                "swapped_out", start, step=step, blocks=swapped_out.get(p.request_id, 0))))
    return out


def step_events(record: StepRecord, resumed: Container[str] = (),
                cached_tokens: Mapping[str, int] | None = None,
                first_tokens: Mapping[str, float] | None = None,
                ) -> list[tuple[str, TimelineEvent]]:
    """(request id, event) for each thing one step did to a request, in the order it happened:
    preempted (and swapped out) while scheduling, admitted or resumed (and swapped in), its
    chunk computed, its first token, its finish.

    The one translation of a step into request events: the engine builds each request's
    timeline with it, and a trace of a replica's recent steps rebuilds the timelines of requests
    still running with it. What the record cannot tell is passed in: which admitted requests
    were preempted before (`resumed`), their prefix-hit tokens (`cached_tokens`), and first
    token times (`first_tokens`, stamped inside the step)."""
    start, end, i = record.start, record.end, record.index
    blocks = dict(record.blocks)
    out = preemption_events(record.preempted, start, i,
                            {rid: a.swapped_out for rid, a in blocks.items()})
    for rid in record.admitted:
        if rid in resumed:
            out.append((rid, TimelineEvent("resumed", start, step=i)))
        else:
            out.append((rid, TimelineEvent("admitted", start, step=i,
                                           num_tokens=(cached_tokens or {}).get(rid, 0))))
        activity = blocks.get(rid)
        if activity is not None and activity.swapped_in:
            out.append((rid, TimelineEvent("swapped_in", start, step=i,
                                           blocks=activity.swapped_in)))
    batch = record.batch_size
    for c in record.chunks:
        out.append((c.request_id, TimelineEvent(c.phase, start, end, i, c.start, c.num_tokens,
                                                batch)))
        first = (first_tokens or {}).get(c.request_id)
        if c.samples and first is not None:
            out.append((c.request_id, TimelineEvent("first_token", first, step=i)))
    out += [(rid, TimelineEvent("finished", end, step=i, detail=reason))
            for rid, reason in record.finished]
    return out


def events_by_request(records: Iterable[StepRecord], resumed: Iterable[str] = (),
                      cached_tokens: Mapping[str, int] | None = None,
                      first_tokens: Mapping[str, float] | None = None,
                      ) -> dict[str, list[TimelineEvent]]:
    """Request id -> the events of `records` (`step_events` of each, in order). A request
    preempted in one record resumes in a later one; `resumed` names those preempted before the
    first. The engine calls it with each step's record as it runs; a trace calls it with a
    replica's recent steps, for the requests still running."""
    out: dict[str, list[TimelineEvent]] = {}
    preempted = set(resumed)
    for record in records:
        preempted.update(p.request_id for p in record.preempted)
        for rid, event in step_events(record, preempted, cached_tokens, first_tokens):
            out.setdefault(rid, []).append(event)
    return out


@dataclass
class StepHistory:
    """The engine's recent steps, a ring buffer of `capacity` records (0: recording is off,
    and requests keep no timeline either). Appends and copies are single deque operations,
    so another thread (a replica's status call) may read it while the engine steps."""

    capacity: int
    steps: deque[StepRecord] = field(init=False)
    # the timelines of the last requests that ended (a replica's trace draws their queueing)
    timelines: deque[RequestTimeline] = field(init=False)
    # perf_counter -> Unix time, taken once: one clock for every record and timeline
    wall_offset: float = field(default_factory=lambda: time.time() - time.perf_counter())
    seconds: float = 0.0  # spent recording (records and timeline events): its overhead

    def __post_init__(self) -> None:
        self.steps = deque(maxlen=max(self.capacity, 0) or None)
        self.timelines = deque(maxlen=max(self.capacity // 8, 1))

    @property
    def enabled(self) -> bool:
        return self.capacity > 0

    def append(self, record: StepRecord) -> None:
        if self.capacity > 0:
            self.steps.append(record)

    def ended(self, timeline: RequestTimeline) -> None:
        if self.capacity > 0:
            self.timelines.append(timeline)

    def recent(self, n: int | None = None) -> list[StepRecord]:
        """The last `n` records (all kept ones by default), oldest first."""
        steps = list(self.steps)
        return steps if n is None else steps[-n:] if n > 0 else []
