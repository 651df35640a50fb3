"""A checker for the Chrome Trace Event Format, as the tests read the spec: what Perfetto and
chrome://tracing need from a JSON trace (used by test_timeline and test_cli_trace)."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

# the phases kvserve writes, and the others the format defines
PHASES = set("BEXiIC") | {"M", "b", "e", "n", "s", "t", "f", "P", "O", "N", "D", "R", "c"}
METADATA = {"process_name", "process_labels", "process_sort_index", "thread_name",
            "thread_sort_index"}


def trace_format_errors(trace: dict[str, Any]) -> list[str]:
    """Every way `trace` breaks the format (empty when it follows it): required keys and
    phase values, timestamps never going back on a track, every B matched by its E."""
    errors: list[str] = []
    events = trace.get("traceEvents")
    if not isinstance(events, list) or not events:
        return ["traceEvents must be a non-empty list"]
    last_ts: dict[tuple, float] = {}
    open_slices: dict[tuple, list[str]] = defaultdict(list)
    for n, e in enumerate(events):
        ph = e.get("ph")
        if ph not in PHASES:
            errors.append(f"event {n}: phase {ph!r} is not in the format")
            continue
        for key in ("name", "pid", "tid") if ph == "M" else ("name", "ph", "ts", "pid", "tid"):
            if key not in e:
                errors.append(f"event {n} ({ph}): no {key!r}")
        if ph == "M":
            if e.get("name") not in METADATA or not isinstance(e.get("args"), dict):
                errors.append(f"event {n}: metadata {e.get('name')!r} without args")
            continue
        if not isinstance(e.get("ts"), int | float):
            errors.append(f"event {n}: ts {e.get('ts')!r} is not a number")
            continue
        track = (e["pid"], e["tid"])
        if ph == "C":
            track = (e["pid"], "counter", e["name"])
            if not e.get("args") or not all(isinstance(v, int | float)
                                            for v in e["args"].values()):
                errors.append(f"event {n}: counter {e['name']!r} needs numeric args")
        if e["ts"] < last_ts.get(track, float("-inf")):
            errors.append(f"event {n}: ts {e['ts']} goes back on track {track}")
        last_ts[track] = e["ts"]
        if ph == "i" and e.get("s", "t") not in ("g", "p", "t"):
            errors.append(f"event {n}: instant scope {e.get('s')!r}")
        if ph == "X" and not isinstance(e.get("dur"), int | float):
            errors.append(f"event {n}: complete event without dur")
        if ph == "B":
            open_slices[track].append(e["name"])
        elif ph == "E":
            stack = open_slices[track]
            if not stack:
                errors.append(f"event {n}: E {e['name']!r} with no open B on {track}")
            elif stack[-1] != e["name"]:
                errors.append(f"event {n}: E {e['name']!r} closes B {stack[-1]!r} on {track}")
                stack.pop()
            else:
                stack.pop()
    errors += [f"B {names} never ended on {track}" for track, names in open_slices.items()
               if names]
    return errors
