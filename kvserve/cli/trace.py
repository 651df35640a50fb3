"""`kvserve trace`: generation on a time axis. Runs a workload in-process (the built-in mixed
one, or your prompts) and writes what the engine's step recorder saw: a Chrome/Perfetto trace
(trace.json), a picture of requests and KV usage (timeline.png), and the steps and request
timelines as JSON lines. `--explain PROMPT` prints one request step by step instead."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from kvserve.cli.engine_args import add_engine_args, engine_config
from kvserve.workers.config import output_dir


def add_trace(sub) -> None:
    p = sub.add_parser(
        "trace", help="record a workload's steps and requests: Perfetto trace, picture, explain",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompt", action="append", default=[], metavar="TEXT",
                   help="a prompt to run (repeatable); default: the built-in mixed workload "
                        "(chats, a document prefilled in chunks, a prefix-cache hit, a "
                        "preemption with a swap)")
    p.add_argument("--prompts", type=Path, default=None, metavar="FILE",
                   help="prompts, one per line (or JSON lines with a \"prompt\" field)")
    p.add_argument("--chat", action="store_true",
                   help="wrap each prompt in the model's chat template")
    p.add_argument("--arrive-every", type=int, default=0, metavar="STEPS",
                   help="the i-th prompt arrives at step i*STEPS (default 0: all at once)")
    p.add_argument("--max-tokens", type=int, default=32,
                   help="tokens to generate per prompt, greedy (default 32)")
    p.add_argument("--out", type=Path, default=output_dir("trace"),
                   help="output directory (default: outputs/trace in kvserve's cache, "
                        "$KVSERVE_CACHE_DIR or ~/.cache/kvserve)")
    p.add_argument("--explain", default=None, metavar="PROMPT",
                   help="print this one request step by step: input ids, each layer's KV "
                        "cache, blocks read and written, RoPE positions, the sampled token and "
                        "its top-5 (also written as explain.json)")
    p.add_argument("--cached", action="store_true",
                   help="with --explain: run the prompt's first half once before, so the "
                        "explained run starts with a prefix-cache hit")
    p.add_argument("--busy", action="store_true",
                   help="with --explain: run the built-in mixed workload beside it (batch "
                        "mates, chunked prefill beside decodes, memory pressure)")
    p.add_argument("--deployment", action="store_true",
                   help="trace a running deployment instead: every replica's recent steps and "
                        "last requests (one process per replica in trace.json, a picture each)")
    p.add_argument("--address", default=None,
                   help="with --deployment: the Ray cluster (default: RAY_ADDRESS, else the "
                        "one `kvserve up --detach` started)")
    p.add_argument("--app", default="kvserve", help="with --deployment: the Serve "
                                                     "application (default kvserve)")
    p.add_argument("--json", action="store_true", help="print a JSON summary instead of text")
    add_engine_args(p, "trace")
    p.set_defaults(run=_run_trace)


def _run_trace(args: argparse.Namespace) -> int:
    from kvserve.workers.errors import InvalidRequestError

    try:
        return _trace(args)
    except InvalidRequestError as exc:  # a bad prompt or max_tokens: one line, exit 2
        print(f"kvserve: invalid request: {exc}", file=sys.stderr)
        return 2


def _trace(args: argparse.Namespace) -> int:
    from kvserve.workers.model_executor.loader import resolve_model_dir

    if args.deployment:
        return _trace_deployment(args)
    config = engine_config(args)
    resolve_model_dir(config.model)  # a missing model: one line, before the engine's imports
    if args.explain is not None:
        from kvserve.trace.explain import explain_request, format_explain

        beside, arrive = None, 0
        if args.busy:
            from kvserve.evals.haystack import prose_text
            from kvserve.trace.workload import mixed_workload

            beside, arrive = mixed_workload(prose_text()), 11
        report = explain_request(config, args.explain, args.max_tokens, chat=args.chat,
                                 cached=args.cached, beside=beside, arrive_step=arrive)
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "explain.json").write_text(json.dumps(report, indent=1))
        print(json.dumps(report) if args.json else format_explain(report))
        return 0
    summary = _record(config, args)
    if args.json:
        print(json.dumps(summary))
    else:
        print(_describe(summary))
    return 0


def _record(config, args: argparse.Namespace) -> dict[str, Any]:
    from tqdm import tqdm

    from kvserve.trace.chrome import PHASES, TraceSource, chrome_trace
    from kvserve.trace.picture import draw_timeline
    from kvserve.trace.workload import mixed_workload, prompt_workload, run_workload
    from kvserve.workers.engine import LLMEngine

    prompts = list(args.prompt) + (_read_prompts(args.prompts) if args.prompts else [])
    if prompts:
        workload = prompt_workload(prompts, args.max_tokens, args.arrive_every, args.chat)
    else:
        from kvserve.evals.haystack import prose_text

        workload = mixed_workload(prose_text())
    engine = LLMEngine(config)
    if not engine.history.enabled:
        raise SystemExit("kvserve trace: --timeline-steps 0 turns the recorder off")
    with tqdm(desc="steps", unit="step", disable=args.json) as bar:
        last = run_workload(engine, workload, on_step=lambda _: bar.update())
    steps = engine.recent_steps()
    labels = {r.request_id: r.label for r in workload if r.label}
    source = TraceSource(f"kvserve engine ({engine.info.name})", steps,
                         [o.timeline for o in last.values() if o.timeline], engine.wall_offset,
                         labels)
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    (out / "trace.json").write_text(json.dumps(chrome_trace([source])))
    draw_timeline(source, out / "timeline.png")
    with open(out / "steps.jsonl", "w") as f:
        for step in steps:
            f.write(json.dumps(step.as_dict(engine.wall_offset)) + "\n")
    with open(out / "requests.jsonl", "w") as f:
        for r in workload:
            o = last[r.request_id]
            f.write(json.dumps({**o.timeline.as_dict(), "label": r.label,
                                "usage": vars(o.usage) if o.usage else None}) + "\n")
    kv = engine.kv_stats()
    return {
        "out": str(out), "files": ["trace.json", "timeline.png", "steps.jsonl",
                                   "requests.jsonl"],
        "steps": len(steps), "requests": len(workload),
        "truncated": engine.num_steps > len(steps),
        "prefill_chunks": sum(1 for s in steps for c in s.chunks if not c.is_decode),
        "preemptions": kv.preemptions, "blocks_swapped_out": kv.blocks_swapped_out,
        "blocks_swapped_in": kv.blocks_swapped_in,
        "prefix_hit_tokens": kv.prefix_hit_tokens,
        "seconds": steps[-1].end - steps[0].start if steps else 0.0,
        "step_seconds": {p: sum(getattr(s, f"{p}_s") for s in steps) for p in PHASES},
    }


def _trace_deployment(args: argparse.Namespace) -> int:
    from kvserve.cli.status import NothingRunning, connect

    try:
        connect(args.address)
    except NothingRunning as exc:
        print(f"kvserve: nothing deployed: {exc}", file=sys.stderr)
        return 1
    from kvserve.cluster import local_head
    from kvserve.trace.chrome import chrome_trace
    from kvserve.trace.picture import draw_timeline
    from kvserve.trace.remote import replica_sources

    try:
        sources = replica_sources(args.app)
    finally:
        local_head.disconnect_driver()
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    (out / "trace.json").write_text(json.dumps(chrome_trace(sources)))
    files = ["trace.json"]
    for i, source in enumerate(sources):
        if source.steps:
            files.append(draw_timeline(source, out / f"timeline-{i}.png").name)
    summary = {"out": str(out), "files": files, "replicas": [
        {"name": s.name, "steps": len(s.steps), "requests": len(s.timelines)} for s in sources]}
    if args.json:
        print(json.dumps(summary))
    else:
        for r in summary["replicas"]:
            print(f"{r['name']}: {r['steps']} steps, {r['requests']} recent requests")
        print(f"wrote {', '.join(files)} in {out}/; open trace.json in https://ui.perfetto.dev")
    return 0


def _read_prompts(path: Path) -> list[str]:
    prompts = []
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        prompts.append(json.loads(line)["prompt"] if line.lstrip().startswith("{") else line)
    return prompts


def _describe(s: dict[str, Any]) -> str:
    phases = s["step_seconds"]
    total = sum(phases.values()) or 1.0
    split = ", ".join(f"{p} {v / total:.0%}" for p, v in phases.items() if v)
    lines = [
        f"kvserve trace: {s['requests']} requests, {s['steps']} steps in {s['seconds']:.1f} s"
        + (" (the oldest steps fell out of the recorder: raise --timeline-steps)"
           if s["truncated"] else ""),
        f"  {s['prefill_chunks']} prefill chunks, {s['preemptions']} preemptions, "
        f"{s['blocks_swapped_out']} blocks swapped out / {s['blocks_swapped_in']} in, "
        f"{s['prefix_hit_tokens']} prompt tokens from the prefix cache",
        f"  step time: {split}",
        f"  wrote {', '.join(s['files'])} in {s['out']}/",
        f"  open {s['out']}/trace.json in https://ui.perfetto.dev or chrome://tracing",
    ]
    return "\n".join(lines)


