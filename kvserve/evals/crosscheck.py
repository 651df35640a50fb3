"""Is the study's engine the model? transformers' `generate()` on some of a recall run's samples.

For each RoPE variant, a few answered samples at one length are run again through transformers'
own model (the same converted weights, the same `rope_parameters` override, a fresh rotary module
per call, the prompt as one forward call) with greedy decoding, and the tokens are compared with
the ones the engine logged. Equal, or different only from a proven near-tie on (the reference's
top two logprobs within `NEAR_TIE` at the first difference), is what the engine promises; the
report states the count and every difference. Results go to `crosscheck.jsonl` beside
`samples.jsonl`, one line per sample, so a rerun checks only what is missing.
"""

from __future__ import annotations

import copy
import time
from pathlib import Path
from typing import Any

from kvserve.evals.recall_tasks import RecallSample
from kvserve.evals.results import SampleLog
from kvserve.evals.rope_variants import RopeVariant

NEAR_TIE = 1e-4  # nats between the reference's top two logprobs at the first difference
DEPTH_ORDER = (50.0, 25.0, 75.0, 0.0, 100.0)  # the middle first, then the rest


def pick(samples: list[RecallSample], log: SampleLog, variant: RopeVariant, length: int,
         count: int, key: Any) -> list[RecallSample]:
    """`count` logged samples of `variant` at `length`: index 0 first, spread over depths and
    tasks (passkey at depths 50, 25, 75 for a count of 3)."""
    logged = [s for s in samples if s.length == length and log.has(key(variant, s))]

    def rank(s: RecallSample) -> tuple:
        depth = DEPTH_ORDER.index(s.depth) if s.depth in DEPTH_ORDER else len(DEPTH_ORDER)
        return (s.index, s.task != "passkey", depth, s.depth, s.task)
    return sorted(logged, key=rank)[:count]


def run_crosscheck(samples: list[RecallSample], log: SampleLog, variants: list[RopeVariant],
                   length: int, count: int, out: Path, model: str | None, key: Any,
                   progress: bool = True, check: bool = True) -> list[dict[str, Any]]:
    """Check what is missing (unless `check` is False), then return every check of the picked
    samples that crosscheck.jsonl holds."""
    import torch
    from tqdm import tqdm
    from transformers import AutoModelForCausalLM

    from kvserve.workers.model_executor.loader import (
        load_tokenizer,
        override_rope,
        resolve_model_dir,
    )

    path = out / "crosscheck.jsonl"
    done = SampleLog(path)  # the same append-only, resumable log as samples.jsonl
    todo = [(v, s) for v in variants for s in pick(samples, log, v, length, count, key)
            if check and not done.has(key(v, s))]
    if todo:
        model_dir = resolve_model_dir(model)
        tokenizer = load_tokenizer(model)
        hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        base_config = copy.deepcopy(hf.config)
        for variant, s in tqdm(todo, desc="transformers cross-check", unit="sample",
                               disable=not progress):
            config = copy.deepcopy(base_config)
            if variant.rope_parameters:
                config.rope_parameters = override_rope(base_config, variant.rope_parameters)
            hf.model.rotary_emb = type(hf.model.rotary_emb)(config=config)  # fresh: stateful
            record = log.records[key(variant, s)]
            ids = tokenizer(s.prompt)["input_ids"]
            start = time.perf_counter()
            done.append(compare(hf, ids, record, s.max_tokens) | {
                "key": key(variant, s), "variant": variant.name, "task": s.task,
                "length": s.length, "depth": s.depth, "index": s.index,
                "seconds": round(time.perf_counter() - start, 1)})
    return [done.records[key(v, s)] for v in variants
            for s in pick(samples, log, v, length, count, key) if done.has(key(v, s))]


def compare(hf: Any, ids: list[int], record: dict[str, Any], max_tokens: int) -> dict[str, Any]:
    """transformers' greedy tokens for `ids` against the engine's logged ones."""
    import torch

    prompt = torch.tensor([ids])
    with torch.inference_mode():
        out = hf.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False,
                          max_new_tokens=max_tokens, return_dict_in_generate=True,
                          output_logits=True, pad_token_id=0)
    want = out.sequences[0, len(ids):].tolist()
    got = record["response_token_ids"]
    first = next((i for i, (a, b) in enumerate(zip(got, want, strict=False)) if a != b),
                 None)
    if first is None and len(got) != len(want):
        first = min(len(got), len(want))
    gap = None
    if first is not None and first < len(out.logits):
        top2 = torch.log_softmax(out.logits[first][0].float(), dim=-1).topk(2).values
        gap = float(top2[0] - top2[1])
    return {"engine_tokens": got, "transformers_tokens": want, "equal": first is None,
            "first_difference": first, "reference_top2_gap": gap,
            "near_tie": gap is not None and gap < NEAR_TIE}


def format_crosscheck(results: list[dict[str, Any]], length: int) -> str:
    if not results:
        return ""
    equal = sum(r["equal"] for r in results)
    ties = sum(r["near_tie"] for r in results)
    lines = [f"transformers `generate()` cross-check at {length} tokens "
             "(kvserve/evals/crosscheck.py): "
             f"{equal} of {len(results)} answers token-identical"
             + (f", {ties} differing from a proven near-tie" if ties else ""), "",
             "| variant | task | depth | index | identical | first difference | "
             "reference top-2 gap | transformers s |", "|---|---|---|---|---|---|---|---|"]
    for r in results:
        gap = "-" if r["reference_top2_gap"] is None else f"{r['reference_top2_gap']:.2e}"
        first = "-" if r["first_difference"] is None else str(r["first_difference"])
        lines.append(f"| {r['variant']} | {r['task']} | {r['depth']:g} | {r['index']} | "
                     f"{'yes' if r['equal'] else 'no'} | {first} | {gap} | {r['seconds']} |")
    return "\n".join(lines)
