"""Steps and request timelines as a Chrome Trace Event Format file (Perfetto, chrome://tracing).

One process per engine (a replica, or the in-process engine). In it:
- the "engine steps" track: one slice per step, its phases nested inside (propose,
  schedule, copy, prepare, forward, sample, detokenize), the batch in its args;
- one track per request: "queued" from arrival to admission, a slice per prefill chunk
  ("prefill 0:512") and per decode, "preempted" until it resumes; instants for admission,
  preemption, swaps, the first token and the finish;
- counter tracks: KV blocks (device used, device cached, host used), the batch (requests and
  tokens) and the queues (running, waiting), after each step.

Durations are B/E pairs, so every track reads as nested slices; times are microseconds from the
earliest event, whose Unix time is in `otherData.unix_time_origin_s`.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvserve.workers.core.timeline import (
    PHASES,
    RequestTimeline,
    StepRecord,
    TimelineEvent,
    events_by_request,
)

STEP_TID = 0


@dataclass
class TraceSource:
    """One engine's records: its recent steps and the timelines of its requests (those that
    finished; a request still running is drawn from the steps alone, without its queueing)."""

    name: str
    steps: Sequence[StepRecord]
    timelines: Sequence[RequestTimeline] = ()
    wall_offset: float = 0.0  # perf_counter -> Unix time for this engine's clock
    labels: dict[str, str] = field(default_factory=dict)  # request id -> what it stands for


def chrome_trace(sources: Iterable[TraceSource]) -> dict[str, Any]:
    """The trace file's JSON object for one or more engines."""
    sources = list(sources)
    origin = min((t for s in sources for t in _times(s)), default=0.0)
    events: list[dict[str, Any]] = []
    for pid, source in enumerate(sources, start=1):
        events += _process(pid, source, origin)
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {"unix_time_origin_s": origin, "generator": "kvserve trace"}}


def _times(source: TraceSource) -> Iterable[float]:
    """Unix times of the source's steps and arrivals (the earliest is the trace's origin)."""
    off = source.wall_offset
    yield from (s.start + off for s in source.steps)
    yield from (t.events[0].start + off for t in source.timelines if t.events)


def source_origin(source: TraceSource) -> float:
    """The source's earliest time, on its own perf_counter clock."""
    return min(_times(source), default=source.wall_offset) - source.wall_offset


def _process(pid: int, source: TraceSource, origin: float) -> list[dict[str, Any]]:
    def us(t: float) -> float:
        return round((t + source.wall_offset - origin) * 1e6, 3)

    events = [_meta(pid, STEP_TID, "process_name", name=source.name),
              _meta(pid, STEP_TID, "thread_name", name="engine steps"),
              _meta(pid, STEP_TID, "thread_sort_index", sort_index=-1)]
    for step in source.steps:
        events += _step(pid, step, us)
    timelines = request_events(source)
    for tid, (rid, evs) in enumerate(timelines.items(), start=1):
        label = source.labels.get(rid)
        events.append(_meta(pid, tid, "thread_name",
                            name=f"request {rid}" + (f" ({label})" if label else "")))
        events.append(_meta(pid, tid, "thread_sort_index", sort_index=tid))
        events += _request(pid, tid, evs, us)
    return events


def _meta(pid: int, tid: int, kind: str, **args: Any) -> dict[str, Any]:
    return {"name": kind, "ph": "M", "pid": pid, "tid": tid, "args": args}


def _step(pid: int, step: StepRecord, us) -> list[dict[str, Any]]:
    args = {"batch_size": step.batch_size, "tokens": step.num_tokens,
            "prefill_tokens": step.num_prefill_tokens, "decodes": step.num_decodes,
            "requests": [f"{c.request_id} {c.phase} {c.start}:{c.end}" for c in step.chunks]}
    if step.admitted:
        args["admitted"] = list(step.admitted)
    if step.preempted:
        args["preempted"] = [f"{p.request_id} ({'swap' if p.swapped else 'recompute'})"
                             for p in step.preempted]
    if step.finished:
        args["finished"] = [f"{rid} ({reason})" for rid, reason in step.finished]
    if step.blocks:
        args["kv_blocks"] = {rid: a.as_dict() for rid, a in step.blocks}
    name = f"step {step.index}"
    out = [{"name": name, "cat": "step", "ph": "B", "ts": us(step.start), "pid": pid,
            "tid": STEP_TID, "args": args}]
    t = step.start
    for phase in PHASES:
        seconds = getattr(step, f"{phase}_s")
        if seconds > 0:
            out.append({"name": phase, "cat": "phase", "ph": "B", "ts": us(t), "pid": pid,
                        "tid": STEP_TID})
            t += seconds
            out.append({"name": phase, "cat": "phase", "ph": "E", "ts": us(t), "pid": pid,
                        "tid": STEP_TID})
    end = us(step.end)
    out.append({"name": name, "cat": "step", "ph": "E", "ts": end, "pid": pid,
                "tid": STEP_TID})
    counters = {
        "KV blocks": {"device_used": step.kv_device_used, "device_cached": step.kv_device_cached,
                      "host_used": step.kv_host_used},
        "batch": {"requests": step.batch_size, "tokens": step.num_tokens},
        "queue": {"running": step.num_running, "waiting": step.num_waiting},
    }
    out += [{"name": n, "ph": "C", "ts": end, "pid": pid, "tid": STEP_TID, "args": a}
            for n, a in counters.items()]
    return out


def request_events(source: TraceSource) -> dict[str, list[TimelineEvent]]:
    """Each request's events: its own timeline where it finished, else rebuilt from the
    steps (`events_from_steps`), in the order they arrived."""
    own = {t.request_id: list(t.events) for t in source.timelines if t.events}
    rebuilt = events_from_steps(source.steps)
    events = {rid: own.get(rid) or rebuilt[rid] for rid in dict.fromkeys([*own, *rebuilt])}
    return dict(sorted(events.items(), key=lambda item: item[1][0].start))


def events_from_steps(steps: Sequence[StepRecord]) -> dict[str, list[TimelineEvent]]:
    """Request id -> the timeline events the steps show (`timeline.events_by_request`; all but
    arrival, first token and prefix hits): for requests still running, or engines that send
    only their steps."""
    return events_by_request(steps)


def _request(pid: int, tid: int, events: list[TimelineEvent], us) -> list[dict[str, Any]]:
    """B/E slices for queueing, computing and preemption; instants for the rest."""
    out: list[dict[str, Any]] = []
    open_slice: str | None = None  # "queued" or "preempted", until the request runs again

    def begin(name: str, t: float, **args: Any) -> None:
        out.append({"name": name, "cat": "request", "ph": "B", "ts": us(t), "pid": pid,
                    "tid": tid, **({"args": args} if args else {})})

    def finish(name: str, t: float) -> None:
        out.append({"name": name, "cat": "request", "ph": "E", "ts": us(t), "pid": pid,
                    "tid": tid})

    for e in events:
        if e.kind == "arrived":
            begin("queued", e.start)
            open_slice = "queued"
            continue
        if open_slice is not None and e.kind in ("admitted", "resumed", "finished",
                                                 "prefill", "decode"):
            finish(open_slice, e.start)
            open_slice = None
        if e.kind in ("prefill", "decode"):
            name = f"prefill {e.first}:{e.first + e.num_tokens}" if e.kind == "prefill" \
                else "decode"
            begin(name, e.start, step=e.step, position=e.first, tokens=e.num_tokens,
                  batch_size=e.batch_size)
            finish(name, e.end if e.end is not None else e.start)
            continue
        args = {k: v for k, v in (("step", e.step), ("cached_tokens", e.num_tokens),
                                  ("blocks", e.blocks), ("detail", e.detail)) if v}
        out.append({"name": e.kind, "cat": "request", "ph": "i", "s": "t", "ts": us(e.start),
                    "pid": pid, "tid": tid, **({"args": args} if args else {})})
        if e.kind == "preempted":
            begin("preempted", e.start, mode=e.detail)
            open_slice = "preempted"
    if open_slice is not None and events:  # still queued or preempted when the trace ends
        last = events[-1]
        finish(open_slice, last.end if last.end is not None else last.start)
    # the first token is stamped inside its step, before the step's end: into its slice
    return sorted(out, key=lambda e: e["ts"])
