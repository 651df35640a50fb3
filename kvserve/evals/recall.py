"""`kvserve eval recall`: long-context recall per RoPE variant, task, length and needle depth.

For every variant the model is loaded with that RoPE override (in-process; a deployment runs
the model as deployed, so `--target` allows only `none`), every sample is answered greedily, and
each finished sample is appended to `samples.jsonl` at once: a rerun with the same `--out`
skips what is there. The report: `results.json` (lm-evaluation-harness's shape, one task entry
per variant x task x length, averaged over depths), `results.csv` (every cell, depth included),
a heatmap per variant (depth x length), `recall_vs_length.png` (one line per variant, the
trained length marked) and `report.md`, naming each variant's effective context length: the
longest length whose score, and every shorter length's, stays at or above the threshold.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tqdm import tqdm

from kvserve.evals import plots
from kvserve.evals.crosscheck import format_crosscheck, run_crosscheck
from kvserve.evals.generation import GenRequest, make_generator
from kvserve.evals.recall_tasks import RecallSample, build_sample
from kvserve.evals.results import SampleLog, metric_entry, write_csv, write_results
from kvserve.evals.rope_variants import RopeVariant
from kvserve.evals.scoring import TASK_METRICS, score_sample, summarize_cell
from kvserve.workers.config import EngineConfig, output_dir
from kvserve.workers.model_executor.loader import DEFAULT_MODEL

VERSION = 1
MAIN_METRIC = "string_match_all"  # RULER's headline score, 0-100 in the report


@dataclass
class RecallConfig:
    tasks: list[str]
    lengths: list[int]
    depths: list[float]
    variants: list[RopeVariant]
    samples: int  # per (length, depth) cell
    samples_at: dict[int, int] = field(default_factory=dict)  # length -> samples, overriding
    variant_lengths: dict[str, list[int]] = field(default_factory=dict)  # name -> its lengths
    crosscheck: tuple[int, int] | None = None  # (samples per variant, length): vs transformers
    report_only: bool = False  # report what samples.jsonl holds; answer and check nothing
    seed: int = 0
    haystack: str = "noise"  # noise | prose | the text of a user's file
    haystack_name: str = "noise"
    value_kind: str = "numbers"
    threshold: float = 85.6  # effective length: score >= this (RULER's Llama-2-7B 4K score)
    out: Path = field(default_factory=lambda: output_dir("eval/recall"))
    target: str | None = None  # a running deployment instead of in-process
    engine: dict[str, Any] = field(default_factory=dict)  # EngineConfig fields

    def samples_for(self, length: int) -> int:
        return self.samples_at.get(length, self.samples)

    def lengths_for(self, variant: RopeVariant) -> list[int]:
        """The lengths `variant` runs at: all of them unless restricted (`--rope yarn:4@16k`)."""
        return self.variant_lengths.get(variant.name, self.lengths)

    def check(self) -> None:
        if self.crosscheck and self.crosscheck[1] not in self.lengths:
            raise ValueError(f"--crosscheck ...@{self.crosscheck[1]}: that length must be among "
                             "--lengths")
        for name, lengths in self.variant_lengths.items():
            if not set(lengths) <= set(self.lengths):
                raise ValueError(f"--rope {name}@...: its lengths must be among --lengths")
        if self.target and any(v.rope_parameters for v in self.variants):
            raise ValueError("--rope overrides need in-process mode: a deployment (--target) "
                             "runs the model as deployed; use --rope none with --target")


def sample_key(variant: RopeVariant, s: RecallSample) -> str:
    return f"{variant.name}|{s.task}|{s.length}|{s.depth:g}|{s.index}|{s.sample_id}"


def build_all(cfg: RecallConfig, tokenizer: Any) -> list[RecallSample]:
    return [build_sample(task, tokenizer, length, depth, i, cfg.seed, cfg.haystack,
                         cfg.value_kind)
            for task in cfg.tasks for length in cfg.lengths for depth in cfg.depths
            for i in range(cfg.samples_for(length))]


def run_recall(cfg: RecallConfig, progress: bool = True) -> dict[str, Any]:
    from kvserve.workers.model_executor.loader import load_tokenizer

    cfg.check()
    cfg.out.mkdir(parents=True, exist_ok=True)
    tokenizer = load_tokenizer(cfg.engine.get("model"))
    samples = build_all(cfg, tokenizer)
    log = SampleLog(cfg.out / "samples.jsonl")
    for variant in [] if cfg.report_only else cfg.variants:
        pending = [s for s in samples if s.length in cfg.lengths_for(variant)
                   and not log.has(sample_key(variant, s))]
        if pending:
            _answer(cfg, variant, pending, log, progress)
    checks: list[dict[str, Any]] = []
    if cfg.crosscheck:
        count, length = cfg.crosscheck
        checks = run_crosscheck(samples, log, cfg.variants, length, count, cfg.out,
                                cfg.engine.get("model"), sample_key, progress,
                                check=not cfg.report_only)
    return report(cfg, samples, log, trained_length(cfg), checks)


def _answer(cfg: RecallConfig, variant: RopeVariant, pending: list[RecallSample],
            log: SampleLog, progress: bool) -> None:
    longest = max(s.prompt_tokens + s.max_tokens for s in pending)
    config = EngineConfig(**{"max_model_len": longest, **cfg.engine},
                          rope_parameters=variant.rope_parameters)
    generator = make_generator(config, cfg.target)
    by_id = {sample_key(variant, s): s for s in pending}
    bar = tqdm(total=len(pending), desc=f"recall {variant.name}", unit="sample",
               disable=not progress)

    last = [time.perf_counter()]

    def done(result) -> None:
        s = by_id[result.request_id]
        now = time.perf_counter()
        log.append(_record(variant, s, result.text, result.token_ids, now - last[0]))
        last[0] = now
        bar.update()

    # short lengths first, for early, steady progress. Within a length, deepest needles first:
    # the haystack before a needle is the same in every sample of a task, so with prefix
    # caching on each later sample reuses the KV computed for an earlier one up to its needle
    # (`--enable-prefix-caching --max-num-seqs 1` makes that the whole shared prefix).
    order = sorted(pending, key=lambda s: (s.length, s.task, -s.depth, s.index))
    requests = [GenRequest(sample_key(variant, s), {"temperature": 0, "max_tokens": s.max_tokens},
                           prompt=s.prompt) for s in order]
    for length in sorted({s.length for s in pending}):
        generator.generate([r for r in requests if by_id[r.request_id].length == length], done)
    bar.close()


def _record(variant: RopeVariant, s: RecallSample, text: str, token_ids: list[int],
            seconds: float) -> dict:
    """A sample's log line. `seconds` is the time since the previous sample finished (its own
    time when samples run one at a time), `machine` the CPU or GPU that answered it."""
    return {"key": sample_key(variant, s), "variant": variant.name, "task": s.task,
            "length": s.length, "depth": s.depth, "index": s.index, "seed": s.seed,
            "prompt_hash": s.sample_id, "prompt_tokens": s.prompt_tokens,
            "targets": list(s.targets), "response": text, "response_token_ids": token_ids,
            "scores": score_sample(s.task, text, s.targets), "seconds": round(seconds, 2),
            "machine": _machine()}


def _machine() -> str:
    import torch

    from kvserve.workers.model_executor.cpu_kernels import cpu_summary

    if torch.cuda.is_available():
        return torch.cuda.get_device_name()
    return f"{cpu_summary()}, {torch.get_num_threads()} threads"


def trained_length(cfg: RecallConfig) -> int | None:
    from kvserve.workers.model_executor.loader import resolve_model_dir

    path = resolve_model_dir(cfg.engine.get("model")) / "config.json"
    return json.loads(path.read_text()).get("max_position_embeddings") if path.exists() else None


def report(cfg: RecallConfig, samples: list[RecallSample], log: SampleLog,
           trained: int | None, checks: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    cells = _cells(cfg, samples, log)
    variants = {v.name: v for v in cfg.variants}
    results, n_samples, rows = {}, {}, []
    for (variant_name, task, length), by_depth in cells.items():
        variant = variants[variant_name]
        scores = [r["scores"] for records in by_depth.values() for r in records]
        name = f"{task}_{length}_{variant.slug}"
        summaries = {m: summarize_cell([s[m] for s in scores]) for m in TASK_METRICS[task]}
        results[name] = metric_entry({m: v["mean"] for m, v in summaries.items()},
                                     {m: v["stderr"] for m, v in summaries.items()})
        n_samples[name] = {"original": len(cfg.depths) * cfg.samples_for(length),  # planned
                           "effective": len(scores)}
        rows += [_csv_row(variant, task, length, depth, records)
                 for depth, records in by_depth.items()]
    curves = _curves(cells)
    effective = {v: effective_length(points, cfg.threshold) for v, points in curves.items()}
    paths = _write_files(cfg, results, n_samples, rows, curves, trained)
    summary = format_table(curves, effective, cfg.threshold, trained)
    parts = [format_cells(cells), format_separations(cells), format_timing(cells)]
    if checks and cfg.crosscheck:
        parts.append(format_crosscheck(checks, cfg.crosscheck[1]))
    details = "\n\n".join(parts)
    (cfg.out / "report.md").write_text(f"{summary}\n\n{details}\n")
    return {"results": results, "effective_length": effective, "files": paths,
            "summary": summary}


def _cells(cfg: RecallConfig, samples: list[RecallSample], log: SampleLog) -> dict:
    """(variant, task, length) -> depth -> the logged records of that cell."""
    cells: dict = {}
    for variant in cfg.variants:
        for s in samples:
            if s.length not in cfg.lengths_for(variant):
                continue
            record = log.records.get(sample_key(variant, s))
            if record is not None:
                cells.setdefault((variant.name, s.task, s.length), {}).setdefault(
                    s.depth, []).append(record)
    return cells


def _csv_row(variant: RopeVariant, task: str, length: int, depth: float,
             records: list[dict]) -> dict[str, Any]:
    cell = summarize_cell([r["scores"][MAIN_METRIC] for r in records])
    part = summarize_cell([r["scores"]["string_match_part"] for r in records])
    return {"variant": variant.name, "task": task, "length": length, "depth": depth,
            "n": cell["n"], MAIN_METRIC: 100 * cell["mean"], "ci_low": 100 * cell["ci_low"],
            "ci_high": 100 * cell["ci_high"], "string_match_part": 100 * part["mean"]}


def _curves(cells: dict) -> dict[str, dict[int, dict[float, float]]]:
    """variant -> length -> depth -> the main score (0-100), averaged over tasks."""
    sums: dict = {}
    for (variant, _task, length), by_depth in cells.items():
        for depth, records in by_depth.items():
            entry = sums.setdefault(variant, {}).setdefault(length, {}).setdefault(
                depth, [])
            entry += [100 * r["scores"][MAIN_METRIC] for r in records]
    return {v: {n: {d: sum(x) / len(x) for d, x in by_depth.items()}
                for n, by_depth in by_length.items()} for v, by_length in sums.items()}


def length_scores(by_length: dict[int, dict[float, float]]) -> dict[int, float]:
    return {n: sum(d.values()) / len(d) for n, d in sorted(by_length.items())}


def effective_length(by_length: dict[int, dict[float, float]], threshold: float) -> int | None:
    """The longest length that, with every shorter one, scores at least `threshold`."""
    best = None
    for length, score in length_scores(by_length).items():
        if score < threshold:
            break
        best = length
    return best


def _write_files(cfg: RecallConfig, results: dict, n_samples: dict, rows: list[dict],
                 curves: dict, trained: int | None) -> list[str]:
    config = {"model": cfg.engine.get("model") or DEFAULT_MODEL,
              "tasks": cfg.tasks, "lengths": cfg.lengths, "depths": cfg.depths,
              "rope": [v.name for v in cfg.variants], "samples": cfg.samples,
              "samples_at": cfg.samples_at, "variant_lengths": cfg.variant_lengths,
              "crosscheck": cfg.crosscheck,
              "seed": cfg.seed,
              "haystack": cfg.haystack_name, "value_kind": cfg.value_kind,
              "threshold": cfg.threshold, "target": cfg.target, "trained_length": trained}
    paths = [write_results(cfg.out, results, config, dict.fromkeys(results, VERSION), n_samples),
             write_csv(cfg.out / "results.csv", rows)]
    for variant in cfg.variants:
        by_length = curves.get(variant.name, {})
        scores = {(n, d): s for n, by_depth in by_length.items() for d, s in by_depth.items()}
        paths.append(plots.heatmap(cfg.out / f"heatmap_{variant.slug}.png",
                                   f"recall, RoPE {variant.name}",
                                   sorted(cfg.lengths_for(variant)),
                                   sorted(cfg.depths), scores))
    series = {v: list(length_scores(by_length).items()) for v, by_length in curves.items()}
    paths.append(plots.lines(cfg.out / "recall_vs_length.png", "recall vs context length",
                             "context length (tokens)", f"{MAIN_METRIC} (0-100)", series,
                             vline=trained, vline_label="trained length",
                             threshold=cfg.threshold))
    return [str(p) for p in paths + [cfg.out / "samples.jsonl", cfg.out / "report.md"]]


def format_table(curves: dict, effective: dict, threshold: float, trained: int | None) -> str:
    lengths = sorted({n for by_length in curves.values() for n in by_length})
    head = "| RoPE | " + " | ".join(f"{n}" for n in lengths) + " | effective length |"
    lines = [f"Recall ({MAIN_METRIC}, 0-100, mean over tasks and depths); trained length "
             f"{trained}; effective length: longest length scoring >= {threshold:g}", "",
             head, "|" + "---|" * (len(lengths) + 2)]
    for variant, by_length in curves.items():
        scores = length_scores(by_length)
        cells = " | ".join(f"{scores[n]:.1f}" if n in scores else "-" for n in lengths)
        lines.append(f"| {variant} | {cells} | {effective[variant] or '< ' + str(lengths[0])} |")
    return "\n".join(lines)



def _interval_cells(cells: dict) -> dict[tuple[str, str, int], dict[str, float | int]]:
    """(variant, task or "both", length) -> the main metric's mean, n and Wilson interval,
    over every depth; "both" pools the tasks' samples."""
    scores: dict[tuple[str, str, int], list[float]] = {}
    for (variant, task, length), by_depth in cells.items():
        values = [r["scores"][MAIN_METRIC] for records in by_depth.values() for r in records]
        scores.setdefault((variant, task, length), []).extend(values)
        scores.setdefault((variant, "both", length), []).extend(values)
    return {key: summarize_cell(values) for key, values in scores.items()}


def format_cells(cells: dict) -> str:
    """One table per task (and both pooled): each cell's score with its 95 % Wilson interval
    and its count of right answers, so a reader sees what the samples can tell apart."""
    summaries = _interval_cells(cells)
    lengths = sorted({n for _, _, n in summaries})
    variants = list(dict.fromkeys(v for v, _, _ in summaries))
    out = [f"Per cell: {MAIN_METRIC} (0-100) [95 % Wilson interval] (right / samples), "
           "over all depths"]
    for task in sorted({t for _, t, _ in summaries} - {"both"}) + ["both"]:
        out += ["", f"**{task}**", "", "| RoPE | " + " | ".join(map(str, lengths)) + " |",
                "|" + "---|" * (len(lengths) + 1)]
        for variant in variants:
            row = []
            for n in lengths:
                c = summaries.get((variant, task, n))
                row.append("-" if c is None else
                           f"{100 * c['mean']:.0f} [{100 * c['ci_low']:.0f}, "
                           f"{100 * c['ci_high']:.0f}] ({round(c['mean'] * c['n'])}/{c['n']})")
            out.append(f"| {variant} | " + " | ".join(row) + " |")
    return "\n".join(out)


def separations(cells: dict) -> list[tuple[str, int, str, str]]:
    """(task or "both", length, better, worse) for every pair of variants whose 95 % Wilson
    intervals do not overlap: the only differences the study may state as conclusions."""
    summaries = _interval_cells(cells)
    found = []
    for (a, task, n), ca in summaries.items():
        for (b, task_b, n_b), cb in summaries.items():
            if (task_b, n_b) == (task, n) and a != b and ca["ci_low"] > cb["ci_high"]:
                found.append((task, n, a, b))
    return sorted(found, key=lambda f: (f[0] != "both", f[0], f[1], f[2], f[3]))


def format_separations(cells: dict) -> str:
    found = separations(cells)
    lines = ["Separated (95 % Wilson intervals do not overlap; nothing else is a conclusion):",
             ""]
    lines += [f"- {task}, {n}: {better} > {worse}" for task, n, better, worse in found]
    return "\n".join(lines if found else lines + ["- none"])


def format_timing(cells: dict) -> str:
    """Per length: samples, their median and mean time (logged per sample since `seconds` was
    recorded; a run paused or sharing its CPU inflates the mean, hardly the median), the total,
    and the machines that answered them."""
    by_length: dict[int, list[dict]] = {}
    for (_, _, length), by_depth in cells.items():
        by_length.setdefault(length, []).extend(r for rs in by_depth.values() for r in rs)
    lines = ["| length | samples | timed | median s / sample | mean s / sample | total s (timed) |",
             "|---|---|---|---|---|---|"]
    machines: set[str] = set()
    untimed = 0
    for length, records in sorted(by_length.items()):
        timed = sorted(r["seconds"] for r in records if "seconds" in r)
        untimed += len(records) - len(timed)
        machines |= {r["machine"] for r in records if "machine" in r}
        median = f"{timed[len(timed) // 2]:.1f}" if timed else "-"
        mean = f"{sum(timed) / len(timed):.1f}" if timed else "-"
        lines.append(f"| {length} | {len(records)} | {len(timed)} | {median} | {mean} | "
                     f"{sum(timed):.0f} |")
    lines += ["", "Machines: " + ("; ".join(sorted(machines)) or "not recorded")
              + (f" ({untimed} samples answered before time and machine were logged)"
                 if untimed else "")]
    return "Time per sample (time since the previous sample finished):\n\n" + "\n".join(lines)
