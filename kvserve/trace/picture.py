"""A picture of a trace: requests as rows coloured by phase, and below them, on the same time
axis, KV blocks in use (device and host) and the batch size of each step."""

from __future__ import annotations

from pathlib import Path

from kvserve.trace.chrome import TraceSource, request_events, source_origin

COLOURS = {"queued": "#c8c8c8", "prefill": "#1f77b4", "decode": "#2ca02c",
           "preempted": "#d62728", "swapped": "#ff7f0e"}


def request_spans(source: TraceSource) -> dict[str, list[tuple[str, float, float]]]:
    """Request id -> (phase, start, end) spans in seconds from the source's first step:
    queued, prefill, decode, and preempted ("swapped" when its KV waits in the host tier)."""
    timelines = request_events(source)
    origin = source_origin(source)
    out: dict[str, list[tuple[str, float, float]]] = {}
    for rid, events in timelines.items():
        spans: list[tuple[str, float, float]] = []
        waiting: tuple[str, float] | None = None
        for e in events:
            if e.kind == "arrived":
                waiting = ("queued", e.start)
            elif e.kind == "preempted":
                waiting = ("swapped" if e.detail == "swap" else "preempted", e.start)
            elif e.kind in ("admitted", "resumed", "prefill", "decode", "finished") and waiting:
                spans.append((waiting[0], waiting[1] - origin, e.start - origin))
                waiting = None
            if e.kind in ("prefill", "decode") and e.end is not None:
                spans.append((e.kind, e.start - origin, e.end - origin))
        out[rid] = spans
    return out


def draw_timeline(source: TraceSource, path: Path, title: str = "") -> Path:
    """Write the picture (PNG, or any format matplotlib knows from the suffix)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    spans = request_spans(source)
    steps = source.steps
    origin = source_origin(source)
    rows = max(len(spans), 1)
    fig, (ax_req, ax_kv, ax_batch) = plt.subplots(
        3, 1, sharex=True, figsize=(12, 2.5 + 0.28 * rows),
        gridspec_kw={"height_ratios": [max(3, 0.28 * rows), 1.4, 1.0]})
    for y, row in enumerate(spans.values()):
        for phase in ("queued", "preempted", "swapped", "prefill", "decode"):
            bars = [(a, max(b - a, 1e-4)) for p, a, b in row if p == phase]
            if bars:
                ax_req.broken_barh(bars, (y - 0.4, 0.8), color=COLOURS[phase], linewidth=0)
    names = [rid[:10] + (f"  {source.labels[rid]}" if rid in source.labels else "")
             for rid in spans]
    ax_req.set_yticks(range(len(spans)), names, fontsize=7)
    ax_req.invert_yaxis()
    ax_req.set_ylabel("requests")
    ax_req.legend(handles=[Patch(color=c, label=p) for p, c in COLOURS.items()],
                  loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=7)
    ax_req.set_title(title or f"{source.name}: {len(steps)} steps, {len(spans)} requests")
    t = [s.end - origin for s in steps]
    ax_kv.step(t, [s.kv_device_used for s in steps], where="post", label="device used")
    ax_kv.step(t, [s.kv_device_used + s.kv_device_cached for s in steps], where="post",
               label="device used + cached", linestyle=":")
    if any(s.kv_host_used for s in steps):
        ax_kv.step(t, [s.kv_host_used for s in steps], where="post", label="host used")
    ax_kv.set_ylabel("KV blocks")
    ax_kv.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=7)
    ax_batch.step([s.start - origin for s in steps], [s.batch_size for s in steps], where="post",
                  label="requests in the step", color="black")
    ax_batch.set_ylabel("batch")
    ax_batch.yaxis.get_major_locator().set_params(integer=True)
    ax_batch.set_xlabel("seconds")
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def phase_seconds(spans: dict[str, list[tuple[str, float, float]]]) -> dict[str, float]:
    """Total seconds per phase over all requests (a check on the picture's rows)."""
    totals: dict[str, float] = {}
    for row in spans.values():
        for phase, a, b in row:
            totals[phase] = totals.get(phase, 0.0) + (b - a)
    return totals

