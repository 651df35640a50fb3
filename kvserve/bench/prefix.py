"""`kvserve bench prefix`: multi-turn chats with a growing history, under four engine settings.

- `no_caching` vs `caching` (an ample device pool): time to first token per turn. Without
  caching every turn recomputes the whole history; with it only the new messages are computed.
- `pressure_recompute` vs `pressure_host_tier`: prefix caching on, a device pool that fits a
  fraction of the working set; evicted histories and preempted requests are either recomputed,
  or demoted / swapped to the host tier and copied back.

The chats advance in rounds (every conversation's next turn at once) and are greedy, so every
setting computes the same tokens (prefix caching is exact); the report says whether they were.
"""

from __future__ import annotations

import dataclasses
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Any

from tqdm import tqdm

from kvserve.bench.common import greedy_params
from kvserve.workers.config import EngineConfig
from kvserve.workers.core.outputs import KVCacheStats
from kvserve.workers.engine import LLMEngine

SETTINGS = ("no_caching", "caching", "pressure_recompute", "pressure_host_tier")


@dataclass
class ChatWorkload:
    documents: list[str]  # one system document (the history's start) per conversation
    turns: int
    output_len: int

    def question(self, turn: int) -> str:
        return f"Question {turn + 1}: which entry mentions berth {turn % 7 + 1}? Answer briefly."


@dataclass
class SettingResult:
    name: str
    ttft_ms_p50: list[float]  # per turn
    output_tokens: int
    prompt_tokens: int
    cached_tokens: int
    seconds: float
    max_prompt_tokens: int
    stats: KVCacheStats
    outputs: list[list[int]]  # per request, in order

    @property
    def output_tok_s(self) -> float:
        return self.output_tokens / self.seconds

    def to_dict(self) -> dict[str, Any]:
        out = {k: v for k, v in dataclasses.asdict(self).items() if k != "outputs"}
        return out | {"output_tok_s": self.output_tok_s,
                      "prefix_hit_rate": self.cached_tokens / max(1, self.prompt_tokens)}


def make_documents(tokenizer: Any, conversations: int, history_tokens: int) -> list[str]:
    """Distinct harbour logs of about `history_tokens` tokens each."""
    docs = []
    for i in range(conversations):
        lines, j = [f"You answer questions about harbour log {i}."], 0
        while len(tokenizer("\n".join(lines)).input_ids) < history_tokens:
            lines.append(f"Entry {j}: ship {100 * i + j} reached berth {j % 7 + 1} with "
                         f"{12 * j + i} crates of {['tea', 'salt', 'wool', 'tin'][j % 4]}.")
            j += 1
        docs.append("\n".join(lines))
    return docs


def run_chats(engine: LLMEngine, work: ChatWorkload, name: str, progress: bool) -> SettingResult:
    histories: list[list[dict[str, str]]] = [[] for _ in work.documents]
    ttfts, outputs = [], []
    totals = {"prompt": 0, "cached": 0, "output": 0, "max_prompt": 0}
    bar = tqdm(total=work.turns * len(work.documents), desc=name, unit="req",
               disable=not progress)
    start = time.perf_counter()
    for turn in range(work.turns):
        requests = [{"messages": [{"role": "system", "content": doc}, *histories[i],
                                  {"role": "user", "content": work.question(turn)}],
                     "params": greedy_params(work.output_len), "request_id": f"c{i}-t{turn}"}
                    for i, doc in enumerate(work.documents)]
        results = engine.generate_all(requests)
        turn_ttfts = []
        for i, outs in enumerate(results.values()):
            usage = outs[-1].usage
            turn_ttfts.append(usage.time_to_first_token_ms)
            totals["prompt"] += usage.prompt_tokens
            totals["cached"] += usage.cached_tokens
            totals["output"] += usage.completion_tokens
            totals["max_prompt"] = max(totals["max_prompt"], usage.prompt_tokens)
            outputs.append([t for o in outs for t in o.token_ids])
            histories[i] += [{"role": "user", "content": work.question(turn)},
                             {"role": "assistant", "content": "".join(o.text for o in outs)}]
        ttfts.append(statistics.median(turn_ttfts))
        bar.update(len(requests))
    bar.close()
    return SettingResult(name, ttfts, totals["output"], totals["prompt"], totals["cached"],
                         time.perf_counter() - start, totals["max_prompt"], engine.kv_stats(),
                         outputs)


def run_prefix_bench(
    config: EngineConfig, conversations: int = 8, turns: int = 5, history_tokens: int = 1500,
    output_len: int = 16, pool_fraction: float = 0.25, progress: bool = True,
) -> dict[str, Any]:
    """Run the four settings on the same chats; ratios and a printable summary included."""
    if turns < 1:
        raise ValueError("turns must be at least 1")
    say = (lambda msg: print(f"[bench] {msg}", file=sys.stderr, flush=True)) if progress else (
        lambda msg: None)
    base = dataclasses.replace(config, enable_prefix_caching=False, cpu_offload_memory=0,
                               num_host_kv_blocks=None)
    engine = LLMEngine(base)
    work = ChatWorkload(make_documents(engine.tokenizer, conversations, history_tokens), turns,
                        output_len)
    say(f"{conversations} chats x {turns} turns, ~{history_tokens}-token histories")
    results = {"no_caching": run_chats(engine, work, "no_caching", progress)}
    del engine
    engine = LLMEngine(dataclasses.replace(base, enable_prefix_caching=True))
    results["caching"] = run_chats(engine, work, "caching", progress)
    block_size = engine.info.block_size
    del engine
    work_blocks = working_set_blocks(results["caching"], work, block_size)
    pool = max(int(work_blocks * pool_fraction), work_blocks // conversations + 1)
    say(f"memory pressure: device pool {pool} blocks of a {work_blocks}-block working set")
    small = dataclasses.replace(base, enable_prefix_caching=True, num_kv_blocks=pool)
    results["pressure_recompute"] = run_chats(LLMEngine(small), work, "pressure_recompute",
                                              progress)
    with_host = dataclasses.replace(small, num_host_kv_blocks=work_blocks)
    results["pressure_host_tier"] = run_chats(LLMEngine(with_host), work, "pressure_host_tier",
                                              progress)
    return _report(results, work, pool, work_blocks)


def working_set_blocks(result: SettingResult, work: ChatWorkload, block_size: int) -> int:
    """KV blocks the largest round's requests hold together."""
    per_request = -(-(result.max_prompt_tokens + work.output_len) // block_size)
    return len(work.documents) * per_request


def _report(results: dict[str, SettingResult], work: ChatWorkload, pool: int,
            work_blocks: int) -> dict[str, Any]:
    reference = results["no_caching"].outputs
    report: dict[str, Any] = {
        "settings": {name: r.to_dict() for name, r in results.items()},
        # the last turn, the longest history: turn `work.turns` (5 by default), whatever it is
        "ttft_last_turn_ratio": (results["no_caching"].ttft_ms_p50[work.turns - 1]
                                 / results["caching"].ttft_ms_p50[work.turns - 1]),
        "pressure_throughput_ratio": (results["pressure_host_tier"].output_tok_s
                                      / results["pressure_recompute"].output_tok_s),
        "outputs_identical": all(r.outputs == reference for r in results.values()),
        "config": {"conversations": len(work.documents), "turns": work.turns,
                   "output_len": work.output_len, "pressure_pool_blocks": pool,
                   "working_set_blocks": work_blocks},
    }
    report["summary"] = summarize(report)
    return report


def summarize(r: dict[str, Any]) -> str:
    c = r["config"]
    lines = [f"{c['conversations']} chats x {c['turns']} turns (greedy, {c['output_len']} "
             f"tokens per answer); pressure: {c['pressure_pool_blocks']} of "
             f"{c['working_set_blocks']} blocks on the device",
             f"  {'setting':<20}{'TTFT p50 per turn (ms)':<40}{'out tok/s':>10}{'hit %':>7}"
             f"{'swapped':>9}{'restored':>9}{'preempt':>8}"]
    for name, s in r["settings"].items():
        ttfts = " ".join(f"{t:7.0f}" for t in s["ttft_ms_p50"])
        st = s["stats"]
        lines.append(f"  {name:<20}{ttfts:<40}{s['output_tok_s']:10.1f}"
                     f"{100 * s['prefix_hit_rate']:7.1f}{st['blocks_swapped_out']:9d}"
                     f"{st['blocks_restored']:9d}{st['preemptions']:8d}")
    lines += [f"  ttft_last_turn_ratio (turn {c['turns']}, no caching / caching): "
              f"{r['ttft_last_turn_ratio']:.1f}x (target >= 5x)",
              f"  pressure_throughput_ratio (host tier / recompute only): "
              f"{r['pressure_throughput_ratio']:.2f}x (target >= 1.5x)",
              f"  outputs identical across settings: {r['outputs_identical']}"]
    return "\n".join(lines)
