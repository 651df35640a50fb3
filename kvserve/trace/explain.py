"""`kvserve trace --explain`: one request, step by step, as the design this project comes from
draws generation: a time axis t = 0..n, and at each t the tensors that exist, the KV slots
read and written, and the token chosen.

Everything shown is read from the engine's real tensors at that step (`observe_forward`): the
input ids and RoPE positions the model got, the slot each token's K/V was written to, the block
table the attention read, the KV pool's own shape, the logits' top 5. Chunked prefill, a
prefix-cache hit and a preemption (with its swap) show up as what they are: several prefill
steps, a first step that starts past 0, a gap with "preempted" and "swapped in".

`cached=True` runs the prompt's first half before, so the explained run starts on its cached
blocks; `beside` runs other requests with it (`--busy`: the built-in mixed workload: batch
mates, memory pressure).
"""

from __future__ import annotations

from typing import Any

import torch

from kvserve.trace.workload import TraceRequest, run_workload
from kvserve.workers.config import EngineConfig
from kvserve.workers.engine import LLMEngine

TOP = 5


def explain_request(config: EngineConfig | None, prompt: str, max_tokens: int, *,
                    chat: bool = False, cached: bool = False,
                    beside: list[TraceRequest] | None = None, arrive_step: int = 0,
                    engine: LLMEngine | None = None) -> dict[str, Any]:
    """Run `prompt` greedily and return the step-by-step report (JSON-ready).

    `cached`: first run the prompt's first half alone, so the explained run starts on its
    cached blocks (a prefix-cache hit; needs enable_prefix_caching). `beside`: other requests
    that share the engine with it (the explained one arrives at `arrive_step`)."""
    engine = engine or LLMEngine(config)
    source = {"messages": [{"role": "user", "content": prompt}]} if chat else {"prompt": prompt}
    ids = engine.tokenize(**source)
    params = {"max_tokens": max_tokens, "temperature": 0.0, "logprobs": TOP}
    if cached:
        engine.generate_all([{"prompt_token_ids": ids[:len(ids) // 2],
                              "params": {"max_tokens": 1}}])
    rid = f"explain-{engine.num_steps}"
    views: list[dict[str, Any]] = []
    records = {}
    outputs: list = []
    stop_views = engine.observe_forward(lambda v: _capture(v, rid, engine.num_steps, views))
    stop_steps = engine.observe_steps(
        lambda r: records.__setitem__(r.index, r) if rid in r.request_ids else None)
    explained = TraceRequest(arrive_step, {"prompt_token_ids": ids, "params": params,
                                           "request_id": rid}, "explained")
    try:
        run_workload(engine, [*(beside or []), explained],
                     on_output=lambda o: outputs.append(o) if o.request_id == rid else None)
    finally:
        stop_views()
        stop_steps()
    return _report(engine, rid, outputs, views, records)


def _capture(view, rid: str, step: int, out: list[dict[str, Any]]) -> None:
    """The explained request's part of one step's real tensors."""
    if rid not in view.request_ids:
        return
    i = view.request_ids.index(rid)
    a, n = view.row_starts[i], view.num_rows[i]
    entry: dict[str, Any] = {
        "step": step,
        "input_ids": view.input_ids[a:a + n].tolist(),
        "input_shape": list(view.input_ids[a:a + n].shape),
        "batch_input_shape": list(view.input_ids.shape),
        "positions": view.positions[a:a + n].tolist(),
        "slots_written": view.slot_mapping[a:a + n].tolist(),
        "blocks_read": list(view.block_tables[i]),
        "context_len": view.context_lens[i],
        "kv_cache_shapes": [[list(k.shape), list(v.shape)] for k, v in view.kv_cache],
        "kv_dtype": str(view.kv_cache[0][0].dtype).removeprefix("torch."),
        "batch": [r for r in view.request_ids if r != rid],
    }
    if rid in view.sampling_ids:
        logits = view.logits[view.sampling_ids.index(rid)].float()
        logp = torch.log_softmax(logits, dim=-1)
        top = torch.topk(logp, TOP)
        entry["top"] = list(zip(top.indices.tolist(), top.values.tolist(), strict=True))
    out.append(entry)


def _report(engine: LLMEngine, rid: str, outputs: list, views: list[dict[str, Any]],
            records: dict) -> dict[str, Any]:
    last = outputs[-1]
    tokens = [t for o in outputs for t in o.token_ids]
    info = engine.info
    hf = engine.hf_config
    heads = hf.num_attention_heads
    events = last.timeline.events if last.timeline else ()
    notes: dict[int, list[str]] = {}
    for e in events:
        if e.kind in ("preempted", "swapped_out", "swapped_in", "resumed", "admitted"):
            text = {"preempted": f"preempted ({e.detail})",
                    "swapped_out": f"swapped out: {e.blocks} blocks to the host tier",
                    "swapped_in": f"swapped in: {e.blocks} blocks back to the device",
                    "resumed": "resumed",
                    "admitted": f"admitted; prefix-cache hit: {e.num_tokens} prompt tokens"
                    if e.num_tokens else "admitted"}[e.kind]
            # on the request's next step that ran (a preemption happens between its steps)
            at = next((v["step"] for v in views if v["step"] >= e.step), e.step)
            notes.setdefault(at, []).append(text + (f" at step {e.step}" if at != e.step
                                                    else ""))
    bs = info.block_size
    token_texts = engine.token_texts
    steps = []
    sampled = iter(tokens)
    for t, v in enumerate(views):
        first, end = v["positions"][0], v["positions"][-1] + 1
        record = records.get(v["step"])
        written: dict[int, list[int]] = {}
        for slot in v["slots_written"]:
            written.setdefault(slot // bs, []).append(slot % bs)
        step = {
            "t": t, "step": v["step"],
            "phase": "decode" if end - first == 1 and first > 0 else f"prefill {first}:{end}",
            "input_ids": v["input_ids"], "input_shape": v["input_shape"],
            "batch_input_shape": v["batch_input_shape"], "batch": v["batch"],
            "positions": [first, end - 1],
            "kv_cache": {
                "layers": len(v["kv_cache_shapes"]),
                "shape": v["kv_cache_shapes"][0][0],  # [blocks, block_size, kv_heads, head_dim]
                "dtype": v["kv_dtype"],
                "blocks_held": len(v["blocks_read"]),
                "slots_filled": v["context_len"],
                "slots_held": len(v["blocks_read"]) * bs,
                "written": [{"block": b, "slots": [s[0], s[-1]]} for b, s in written.items()],
            },
            "blocks_read": v["blocks_read"],
            "attention_scores_shape": [heads, len(v["input_ids"]), v["context_len"]],
            "seconds": record.seconds if record else None,
            "events": notes.get(v["step"], []),
        }
        if "top" in v:
            token = next(sampled)
            step["token"] = {"id": token, "text": token_texts([token])[0]}
            step["top"] = [{"id": i, "text": token_texts([i])[0], "logprob": lp}
                           for i, lp in v["top"]]
            chosen = [lp for i, lp in v["top"] if i == token]
            step["token"]["logprob"] = chosen[0] if chosen else None
        steps.append(step)
    return {
        "request_id": rid, "model": info.name, "dtype": info.dtype,
        "rope": dict(info.rope_parameters), "block_size": bs, "num_blocks": info.num_blocks,
        "prompt_tokens": last.usage.prompt_tokens if last.usage else None,
        "cached_tokens": last.usage.cached_tokens if last.usage else 0,
        "completion_tokens": last.usage.completion_tokens if last.usage else None,
        "finish_reason": last.finish_reason, "steps": steps,
        "unresolved_events": [n for s, ns in notes.items() if s not in {v["step"] for v in views}
                              for n in ns],
    }


def format_explain(report: dict[str, Any]) -> str:
    """The report as the time-axis text docs/tracing.md shows."""
    rope = report["rope"].get("rope_type", "default")
    lines = [f"request {report['request_id']}: {report['prompt_tokens']} prompt tokens "
             f"({report['cached_tokens']} from the prefix cache), "
             f"{report['completion_tokens']} generated, finish {report['finish_reason']}; "
             f"{report['model']} {report['dtype']}, RoPE {rope}, block size "
             f"{report['block_size']}, {report['num_blocks']} device blocks"]
    for s in report["steps"]:
        kv = s["kv_cache"]
        ids = s["input_ids"]
        shown = ids if len(ids) <= 6 else [*ids[:3], "...", *ids[-2:]]
        written = ", ".join(f"{w['block']}[{w['slots'][0]}:{w['slots'][1] + 1}]"
                            for w in kv["written"][:4]) + (" ..." if len(kv["written"]) > 4
                                                            else "")
        read = s["blocks_read"]
        read_text = str(read) if len(read) <= 6 else (
            f"[{', '.join(map(str, read[:3]))}, ..., {', '.join(map(str, read[-2:]))}] "
            f"({len(read)})")
        secs = f"{s['seconds'] * 1000:.1f} ms" if s["seconds"] is not None else "?"
        lines.append(f"t={s['t']:<3} step {s['step']:<4} {s['phase']:<16} {secs}"
                     + (f"   batch with {len(s['batch'])} other" if s["batch"] else ""))
        for note in s["events"]:
            lines.append(f"       ! {note}")
        lines.append(f"       input_ids {s['input_shape']} {shown}   "
                     f"(batch {s['batch_input_shape']})   RoPE positions "
                     f"{s['positions'][0]}..{s['positions'][1]}")
        lines.append(f"       KV cache x{kv['layers']} layers, K and V each "
                     f"{' x '.join(map(str, kv['shape']))} {kv['dtype']}: "
                     f"{kv['slots_filled']}/{kv['slots_held']} slots of "
                     f"{kv['blocks_held']} blocks; wrote {written}")
        lines.append(f"       attention scores {' x '.join(map(str, s['attention_scores_shape']))}"
                     f" (heads x q x context), read blocks {read_text}")
        if "token" in s:
            tok = s["token"]
            alts = "  ".join(f"{a['text']!r} {a['logprob']:.2f}" for a in s["top"])
            lp = f"{tok['logprob']:.2f}" if tok["logprob"] is not None else "?"
            lines.append(f"       -> {tok['text']!r} ({tok['id']}, logprob {lp});  top-5: "
                         f"{alts}")
    if report["unresolved_events"]:
        lines.append("events between its steps: " + "; ".join(report["unresolved_events"]))
    return "\n".join(lines)
