"""`kvserve eval factuality`: the factual error rate per sampling setting.

Two suites: `closed_book` (short answers graded against aliases, SimpleQA's way) and `grounded`
(a short report on a seeded facts table, every figure and name checked against it). Each
sampling setting of `--sweep` answers the same prompts (a seed per sample, so sampled runs
reproduce); every answered sample goes to `samples.jsonl` at once, and a rerun skips it. The
report: `results.json` (lm-evaluation-harness's shape, one task per suite x setting),
`results_{suite}.csv`, `error_rate_by_setting.png` and `report.md`.
"""

from __future__ import annotations

import itertools
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tqdm import tqdm

from kvserve.evals import plots
from kvserve.evals.factuality import closed_book, grounded
from kvserve.evals.generation import GenRequest, make_generator
from kvserve.evals.results import SampleLog, metric_entry, write_csv, write_results
from kvserve.workers.config import EngineConfig, output_dir
from kvserve.workers.model_executor.loader import DEFAULT_MODEL

VERSION = 1
SUITES = ("closed_book", "grounded")
MAX_TOKENS = {"closed_book": 32, "grounded": 160}
HEADLINE = {"closed_book": ("factual_error_rate", "hallucination_rate", "f1"),
            "grounded": ("error_rate", "samples_with_error")}


@dataclass
class FactualityConfig:
    suites: list[str]
    sweep: list[dict[str, float]]  # sampling settings; [{"temperature": 0.0}]: greedy only
    samples: int = 100  # per suite
    dataset: Path | None = None  # a user's closed-book JSONL; None: the shipped set
    seed: int = 0
    out: Path = field(default_factory=lambda: output_dir("eval/factuality"))
    target: str | None = None
    engine: dict[str, Any] = field(default_factory=dict)


def parse_sweep(text: str | None) -> list[dict[str, float]]:
    """'temperature=0,0.7;top_p=0.9,1' -> the product of the listed values (None: greedy)."""
    if not text:
        return [{"temperature": 0.0}]
    axes = []
    for part in text.split(";"):
        name, sep, values = part.partition("=")
        if not sep or not values:
            raise ValueError(f"--sweep {text!r}: expected NAME=V1,V2,... (e.g. temperature=0,0.7)")
        if name.strip() not in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty"):
            raise ValueError(f"--sweep: {name.strip()!r} is not a sampling setting to sweep")
        axes.append([(name.strip(), float(v)) for v in values.split(",")])
    return [dict(combo) for combo in itertools.product(*axes)]


def setting_name(setting: dict[str, float]) -> str:
    return ",".join(f"{k}={v:g}" for k, v in setting.items())


def build_prompts(cfg: FactualityConfig) -> dict[str, list[tuple[str, Any]]]:
    """suite -> [(sample id, item or table)], the same for every setting."""
    prompts: dict[str, list[tuple[str, Any]]] = {}
    if "closed_book" in cfg.suites:
        items = closed_book.load_dataset(cfg.dataset)
        chosen = random.Random(cfg.seed).sample(items, min(cfg.samples, len(items)))
        prompts["closed_book"] = [(item.id, item) for item in chosen]
    if "grounded" in cfg.suites:
        tables = [grounded.make_table(cfg.seed * 100_000 + i) for i in range(cfg.samples)]
        prompts["grounded"] = [(f"table-{t.seed}", t) for t in tables]
    return prompts


def run_factuality(cfg: FactualityConfig, progress: bool = True) -> dict[str, Any]:
    unknown = set(cfg.suites) - set(SUITES)
    if unknown:
        raise ValueError(f"--suite: unknown {sorted(unknown)}; choose from {', '.join(SUITES)}")
    cfg.out.mkdir(parents=True, exist_ok=True)
    prompts = build_prompts(cfg)
    log = SampleLog(cfg.out / "samples.jsonl")
    requests = _pending_requests(cfg, prompts, log)
    if requests:
        _answer(cfg, requests, log, progress)
    return report(cfg, prompts, log)


def _key(suite: str, setting: dict[str, float], sample_id: str) -> str:
    return f"{suite}|{setting_name(setting)}|{sample_id}"


def _pending_requests(cfg: FactualityConfig, prompts: dict, log: SampleLog) -> list[tuple]:
    pending = []
    for setting in cfg.sweep:
        for suite, samples in prompts.items():
            for i, (sample_id, subject) in enumerate(samples):
                key = _key(suite, setting, sample_id)
                if not log.has(key):
                    params = {"max_tokens": MAX_TOKENS[suite], "seed": cfg.seed + i, **setting}
                    messages = (closed_book if suite == "closed_book" else grounded).prompt_for(
                        subject)
                    pending.append((GenRequest(key, params, messages=messages), suite, subject))
    return pending


def _answer(cfg: FactualityConfig, pending: list[tuple], log: SampleLog, progress: bool) -> None:
    generator = make_generator(EngineConfig(**cfg.engine), cfg.target)
    subjects = {r.request_id: (suite, subject) for r, suite, subject in pending}
    bar = tqdm(total=len(pending), desc="factuality", unit="sample", disable=not progress)

    def done(result) -> None:
        suite, subject = subjects[result.request_id]
        log.append(_record(result.request_id, suite, subject, result.text, result.token_ids))
        bar.update()

    generator.generate([r for r, _, _ in pending], done)
    bar.close()


def _record(key: str, suite: str, subject: Any, text: str, token_ids: list[int]) -> dict:
    record = {"key": key, "suite": suite, "setting": key.split("|")[1],
              "sample_id": key.split("|")[2], "response": text, "response_token_ids": token_ids}
    if suite == "closed_book":
        return record | {"question": subject.question, "answers": subject.answers,
                         "grade": closed_book.grade(text, subject.answers)}
    verdicts = grounded.score_response(text, subject)
    return record | {"table_seed": subject.seed,
                     "claims": [{"text": v.claim.text, "kind": v.claim.kind,
                                 "verdict": v.verdict, "reason": v.reason} for v in verdicts]}


def report(cfg: FactualityConfig, prompts: dict, log: SampleLog) -> dict[str, Any]:
    results, n_samples, rows = {}, {}, []
    series: dict[str, list[tuple[float, float, float]]] = {}
    for setting in cfg.sweep:
        for suite, samples in prompts.items():
            records = log.select(_key(suite, setting, sid) for sid, _ in samples)
            summary = _summarize(suite, records)
            rates = {m: v for m, v in summary.items() if isinstance(v, dict)}
            name = f"{suite}@{setting_name(setting)}"
            results[name] = metric_entry({m: v["value"] for m, v in rates.items()},
                                         {m: _stderr(v["ci95"]) for m, v in rates.items()})
            n_samples[name] = {"original": len(samples), "effective": len(records)}
            rows.append(_row(suite, setting, len(records), rates))
            for metric in HEADLINE[suite]:
                value = rates[metric]
                series.setdefault(f"{suite}: {metric}", []).append(
                    (value["value"], *value["ci95"]))
    files = _write_files(cfg, results, n_samples, rows, series)
    summary = format_table(rows)
    (cfg.out / "report.md").write_text(summary + "\n")
    return {"results": results, "files": files, "summary": summary}


def _summarize(suite: str, records: list[dict]) -> dict[str, Any]:
    if suite == "closed_book":
        return closed_book.summarize([r["grade"] for r in records])
    return grounded.summarize([grounded.score_response(r["response"],
                                                       grounded.make_table(r["table_seed"]))
                               for r in records])


def _stderr(ci95: list[float]) -> float:
    return (ci95[1] - ci95[0]) / 3.92  # the interval's half-width in standard errors


def _row(suite: str, setting: dict, n: int, rates: dict) -> dict[str, Any]:
    row: dict[str, Any] = {"suite": suite, "setting": setting_name(setting), "n": n}
    for metric in HEADLINE[suite]:
        row[metric] = rates[metric]["value"]
        row[f"{metric}_ci_low"], row[f"{metric}_ci_high"] = rates[metric]["ci95"]
    return row


def _write_files(cfg: FactualityConfig, results: dict, n_samples: dict, rows: list[dict],
                 series: dict) -> list[str]:
    config = {"model": cfg.engine.get("model") or DEFAULT_MODEL,
              "suites": cfg.suites, "sweep": cfg.sweep, "samples": cfg.samples,
              "dataset": (str(cfg.dataset) if cfg.dataset
                          else "kvserve/evals/data/closed_book.jsonl"),
              "seed": cfg.seed, "target": cfg.target}
    paths = [write_results(cfg.out, results, config, dict.fromkeys(results, VERSION), n_samples)]
    for suite in {r["suite"] for r in rows}:  # one CSV per suite: their columns differ
        paths.append(write_csv(cfg.out / f"results_{suite}.csv",
                               [r for r in rows if r["suite"] == suite]))
    paths.append(plots.error_bars(cfg.out / "error_rate_by_setting.png",
                                  "factual errors by sampling setting (95% CI)", "rate",
                                  [setting_name(s) for s in cfg.sweep], series))
    return [str(p) for p in paths + [cfg.out / "samples.jsonl", cfg.out / "report.md"]]


def format_table(rows: list[dict]) -> str:
    lines = ["| suite | setting | n | metric | value | 95% CI |", "|---|---|---|---|---|---|"]
    for row in rows:
        for metric in HEADLINE[row["suite"]]:
            lines.append(f"| {row['suite']} | {row['setting']} | {row['n']} | {metric} | "
                         f"{row[metric]:.3f} | [{row[metric + '_ci_low']:.3f}, "
                         f"{row[metric + '_ci_high']:.3f}] |")
    return "\n".join(lines)
