"""`kvserve eval recall` and `kvserve eval factuality`: argument parsing for the evals."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from kvserve.cli.engine_args import add_engine_args, engine_kwargs
from kvserve.cli.types import count_at_length, floats, length_counts, token_lengths, words
from kvserve.workers.config import output_dir


def add_eval(sub) -> None:
    p = sub.add_parser("eval", help="long-context recall and factual error rate evals")
    evals = p.add_subparsers(title="evals")
    _add_recall(evals)
    _add_factuality(evals)
    p.set_defaults(run=lambda args: (p.print_help(), 2)[1])


def _add_common(p: argparse.ArgumentParser, out: str, samples_help: str) -> None:
    p.add_argument("--target", default=None, metavar="HOST:PORT",
                   help="ask a running deployment (`kvserve up`) instead of loading the model")
    p.add_argument("--samples", type=int, default=None, help=samples_help)
    p.add_argument("--seed", type=int, default=0, help="sample construction seed (default 0)")
    p.add_argument("--out", type=Path, default=output_dir(out),
                   help=f"output directory (default: outputs/{out} in kvserve's cache, "
                        "$KVSERVE_CACHE_DIR or ~/.cache/kvserve); rerunning with it resumes")
    p.add_argument("--json", action="store_true", help="print the result as one JSON object")
    # the in-process engine's model and pool (eval's own default: kvserve.workers.config)
    add_engine_args(p, "eval", only=("model", "kv_cache_memory", "enable_prefix_caching",
                                     "max_num_seqs", "tensor_parallel_size",
                                     "tp_step_channel", "num_threads"))


def _add_recall(evals) -> None:
    r = evals.add_parser(
        "recall", help="needle-in-a-haystack recall vs context length, per RoPE scaling",
        description="RULER-style recall (passkey, niah_single, niah_multikey, niah_multivalue, "
                    "niah_multiquery) at each context length and needle depth, for each RoPE "
                    "variant. Writes results.json (lm-evaluation-harness shape), samples.jsonl, "
                    "results.csv, a heatmap per variant, recall_vs_length.png and report.md "
                    "with each variant's effective context length. Greedy; resumable.")
    r.add_argument("--tasks", default="passkey,niah_single", type=words,
                   help="comma-separated (default passkey,niah_single)")
    r.add_argument("--lengths", default="1k,2k,4k", type=token_lengths,
                   help="prompt lengths in tokens, e.g. 1k,2k,4k,8k,16k (default 1k,2k,4k)")
    r.add_argument("--depths", default="0,25,50,75,100", type=floats,
                   help="needle depths in percent (default 0,25,50,75,100)")
    r.add_argument("--rope", default="none", type=words,
                   help="RoPE variants: none, linear:F, dynamic:F, yarn:F, llama3:F, longrope:F, "
                        "with extra keys as yarn:2,beta_fast=32 (default none; separate with ';' "
                        "when a variant has extra keys, else ','); VARIANT@16k or @12k+16k runs "
                        "it at those lengths only")
    r.add_argument("--haystack", default="noise",
                   help="noise (the passkey filler), prose (shipped Python reference prose) or "
                        "a path to your own .txt")
    r.add_argument("--value-kind", default="numbers", choices=["numbers", "words", "uuids"],
                   help="what the needles' values are (default numbers)")
    r.add_argument("--threshold", type=float, default=85.6,
                   help="effective length: the longest length scoring at least this (0-100)")
    _add_common(r, "eval/recall", "samples per (length, depth) cell (default 5)")
    r.add_argument("--crosscheck", default=None, type=count_at_length, metavar="N@LEN",
                   help="after answering, run transformers' generate() on N answered samples "
                        "of each variant at length LEN and compare tokens (e.g. 3@12k); the "
                        "report states how many are identical")
    r.add_argument("--report-only", action="store_true",
                   help="write the report from the samples already in --out, answering nothing "
                        "(a study in progress)")
    r.add_argument("--samples-at", default={}, type=length_counts, metavar="LEN=N,...",
                   help="samples per (length, depth) cell at some lengths, overriding "
                        "--samples there, e.g. 4k=2")
    r.set_defaults(run=_run_recall)


def _add_factuality(evals) -> None:
    f = evals.add_parser(
        "factuality", help="factual error rate: closed-book QA and grounded reports",
        description="Closed-book QA graded without a judge (correct / incorrect / not "
                    "attempted; factual error rate = incorrect / attempted) and grounded "
                    "reports checked claim by claim against the facts table in the prompt. "
                    "--sweep repeats both over sampling settings and plots the error rates.")
    f.add_argument("--suite", default="closed_book,grounded", type=words,
                   help="closed_book, grounded or both (default both)")
    f.add_argument("--dataset", type=Path, default=None,
                   help="your closed-book set: JSONL with question and answers (aliases)")
    f.add_argument("--sweep", default=None,
                   help="sampling settings to compare, e.g. temperature=0,0.3,0.7,1.0 "
                        "(several: temperature=0,0.7;top_p=0.9,1.0 gives their product)")
    _add_common(f, "eval/factuality",
                "questions (closed_book) and reports (grounded) per setting (default 100)")
    f.set_defaults(run=_run_factuality)


def _run_recall(args: argparse.Namespace) -> int:
    from kvserve.evals.recall import run_recall

    report = run_recall(recall_config(args), progress=not args.json)
    print(json.dumps({k: v for k, v in report.items() if k != "summary"}, indent=2)
          if args.json else report["summary"])
    return 0


def recall_config(args: argparse.Namespace):
    """The parsed `kvserve eval recall` arguments as an `kvserve.evals.recall.RecallConfig`."""
    from kvserve.evals.recall import RecallConfig
    from kvserve.evals.rope_variants import parse_rope_variant

    haystack, name = args.haystack, args.haystack
    if haystack not in ("noise", "prose"):
        haystack, name = Path(haystack).read_text(), Path(haystack).name
    specs = [spec.partition("@")[::2] for spec in args.rope]  # "yarn:4@16k" -> (yarn:4, 16k)
    variants = [parse_rope_variant(spec) for spec, _ in specs]
    at = {variant.name: token_lengths(where.replace("+", ","))
          for (_, where), variant in zip(specs, variants, strict=True) if where}
    cfg = RecallConfig(
        tasks=args.tasks, lengths=args.lengths, depths=args.depths,
        variants=variants, samples=args.samples or 5, samples_at=args.samples_at,
        variant_lengths=at, crosscheck=args.crosscheck, report_only=args.report_only,
        seed=args.seed, haystack=haystack, haystack_name=name, value_kind=args.value_kind,
        threshold=args.threshold, out=args.out, target=args.target,
        engine=engine_kwargs(args))
    cfg.check()
    return cfg


def _run_factuality(args: argparse.Namespace) -> int:
    from kvserve.evals.factuality.run import FactualityConfig, parse_sweep, run_factuality

    cfg = FactualityConfig(
        suites=args.suite, dataset=args.dataset, sweep=parse_sweep(args.sweep),
        samples=args.samples or 100, seed=args.seed, out=args.out, target=args.target,
        engine=engine_kwargs(args))
    report = run_factuality(cfg, progress=not args.json)
    print(json.dumps({k: v for k, v in report.items() if k != "summary"}, indent=2)
          if args.json else report["summary"])
    return 0
