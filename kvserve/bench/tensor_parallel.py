"""`kvserve bench throughput -tp N`: where a tensor-parallel step's time goes, beside tp 1 in
the same run.

Three engines on the same prompts: tp 1 (on as many threads as the tp N ranks have together),
tp N with the step channel asked for, and tp N with the other channel (shm ring or gloo
broadcasts). For each tp N run, per step: the time rank 0
spends sending the step's plan, the time from that send to each rank's receipt (measured by the
ranks), and the all-reduces and the logits' gather with the bytes they moved. On a CPU with
fewer cores than ranks x threads, tp N is not expected to be faster than tp 1; the figures say
where its time goes.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import torch

from kvserve.bench.common import run_greedy
from kvserve.workers.config import TP_STEP_CHANNELS, EngineConfig
from kvserve.workers.engine import LLMEngine
from kvserve.workers.model_executor.loader import LoadedCheckpoint


@dataclasses.dataclass
class TPEngines:
    tp1: LLMEngine
    by_channel: dict[str, LLMEngine]  # tp N, the config's channel first
    tp1_threads: int  # every rank's threads together: tp 1 on the cores tp N uses
    rank_threads: int  # rank 0's under tp N

    def shutdown(self) -> None:
        for engine in self.by_channel.values():
            engine.shutdown()


def tp_engines(config: EngineConfig, engine: LLMEngine,
               checkpoint: LoadedCheckpoint | None = None) -> TPEngines:
    """`engine` (tp N, built from `config`), a tp 1 twin and a tp N twin on the other
    channel (`checkpoint`: as `engine` was given it)."""
    other = next(c for c in TP_STEP_CHANNELS if c != config.tp_step_channel)
    rank_threads = torch.get_num_threads()
    tp = config.tensor_parallel_size
    twin = LLMEngine(dataclasses.replace(config, tensor_parallel_size=1, num_threads=None),
                     checkpoint=checkpoint)
    engines = TPEngines(
        twin, {config.tp_step_channel: engine,
               other: LLMEngine(dataclasses.replace(config, tp_step_channel=other),
                                checkpoint=checkpoint)},
        tp1_threads=min(os.cpu_count() or 1, rank_threads * tp), rank_threads=rank_threads)
    torch.set_num_threads(rank_threads)
    return engines


def tp_round(engines: TPEngines, prompts: list[list[int]], output_len: int) -> dict[str, float]:
    """One round: tok/s of tp 1 and of tp N on each channel, and tp N's communication per
    step (`tp_<channel>_*` keys)."""
    torch.set_num_threads(engines.tp1_threads)  # (threads are the process's, not an engine's)
    try:
        run = run_greedy(engines.tp1, prompts, output_len)
    finally:
        torch.set_num_threads(engines.rank_threads)
    result = {"tp1_tok_s": run.tok_s, "tp1_threads": engines.tp1_threads}
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
             f"collectives: {_collectives(r['config']['device'])})",
             f"    {'tp 1':<22}{r['tp1_tok_s']:8.1f} output tok/s   "
             f"on {r['tp1_threads']:.0f} threads: every rank's together"]
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


def _collectives(device: str) -> str:
    if device.startswith("cuda"):
        return "NCCL"
    return "all-reduce in shared memory, logits' gather over gloo"
