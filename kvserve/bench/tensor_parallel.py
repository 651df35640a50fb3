"""`kvserve bench throughput -tp N`: where a tensor-parallel step's time goes, beside tp 1 in
the same run.

Three engines on the same prompts: tp 1, tp N with the step channel asked for, and tp N with
the other channel (shm ring or gloo broadcasts). For each tp N run, per step: the time rank 0
spends sending the step's plan, the time from that send to each rank's receipt (measured by the
ranks), and the all-reduces and the logits' gather with the bytes they moved. On a CPU with
fewer cores than ranks x threads, tp N is not expected to be faster than tp 1; the figures say
where its time goes.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from kvserve.bench.common import run_greedy
from kvserve.workers.config import TP_STEP_CHANNELS, EngineConfig
from kvserve.workers.engine import LLMEngine


@dataclasses.dataclass
class TPEngines:
    tp1: LLMEngine
    by_channel: dict[str, LLMEngine]  # tp N, the config's channel first

    def shutdown(self) -> None:
        for engine in self.by_channel.values():
            engine.shutdown()


def tp_engines(config: EngineConfig, engine: LLMEngine) -> TPEngines:
    """`engine` (tp N, built from `config`), a tp 1 twin and a tp N twin on the other
    channel."""
    other = next(c for c in TP_STEP_CHANNELS if c != config.tp_step_channel)
    return TPEngines(
        LLMEngine(dataclasses.replace(config, tensor_parallel_size=1)),
        {config.tp_step_channel: engine,
         other: LLMEngine(dataclasses.replace(config, tp_step_channel=other))})


def tp_round(engines: TPEngines, prompts: list[list[int]], output_len: int) -> dict[str, float]:
    """One round: tok/s of tp 1 and of tp N on each channel, and tp N's communication per
    step (`tp_<channel>_*` keys)."""
    run = run_greedy(engines.tp1, prompts, output_len)
    result = {"tp1_tok_s": run.tok_s}
    for channel, engine in engines.by_channel.items():
        followers = engine.followers
        stats = followers.group.stats
        followers.latency()  # (starts the ranks' counts afresh)
        stats.reset()
        run = run_greedy(engine, prompts, output_len)
        latency = followers.latency()
        steps = max(1, stats.calls.get("gather", 0))  # one gather per step that samples
        key = f"tp_{channel}_"
        result.update({
            key + "tok_s": run.tok_s,
            key + "steps": run.steps,
            key + "plan_send_ms": 1e3 * stats.seconds.get("step_message", 0.0) / run.steps,
            key + "plan_latency_ms": 1e3 * latency["mean_s"],
            key + "plan_latency_max_ms": 1e3 * latency["max_s"],
            key + "all_reduces_per_step": stats.calls.get("all_reduce", 0) / run.steps,
            key + "all_reduce_ms": 1e3 * stats.seconds.get("all_reduce", 0.0) / run.steps,
            key + "all_reduce_kb": stats.bytes.get("all_reduce", 0) / run.steps / 1e3,
            key + "gather_ms": 1e3 * stats.seconds.get("gather", 0.0) / steps,
            key + "gather_kb": stats.bytes.get("gather", 0) / steps / 1e3,
        })
    return result


def summarize_tp(r: dict[str, Any], tp: int, channels: list[str]) -> list[str]:
    lines = [f"  tensor parallelism: {tp} ranks ({r['config']['device']}; "
             f"collectives: {'nccl' if r['config']['device'].startswith('cuda') else 'gloo'})",
             f"    {'tp 1':<22}{r['tp1_tok_s']:8.1f} output tok/s"]
    for channel in channels:
        k = f"tp_{channel}_"
        lines += [
            f"    {f'tp {tp}, plans by {channel}':<22}{r[k + 'tok_s']:8.1f} output tok/s   "
            f"tp {tp} = {r[k + 'tok_s'] / r['tp1_tok_s']:.2f}x tp 1",
            f"      step plan: sent in {r[k + 'plan_send_ms']:.3f} ms, received "
            f"{r[k + 'plan_latency_ms']:.3f} ms after (max {r[k + 'plan_latency_max_ms']:.2f})",
            f"      all-reduce: {r[k + 'all_reduces_per_step']:.0f} a step, "
            f"{r[k + 'all_reduce_ms']:.2f} ms and {r[k + 'all_reduce_kb']:.1f} KB a step; "
            f"logits' gather {r[k + 'gather_ms']:.2f} ms, {r[k + 'gather_kb']:.0f} KB a step",
        ]
    return lines
