"""`kvserve bench speculative`: output tokens/s with and without speculative decoding.

At batch 1 a decode step reads every weight once for one token, so its time is the time to read
the weights (bench throughput measures it). Speculation verifies several drafted tokens in that
one read: the step costs a little more, and emits its accepted drafts plus one token. Whether it
pays depends on how often drafts are right, so the benchmark runs workloads of both kinds:

- input-grounded (where prompt lookup's drafts come from): the grounded factuality eval's
  company reports (figures and names copied from a table), "rewrite this function" code edits,
  and summaries that quote a passage;
- open-ended chat, where little of the prompt recurs in the answer.

Each workload runs at batch 1 (its prompts one after another) and batch 8 (side by side) on
two engines built from the same checkpoint and settings, without speculation and with it,
greedy, so both must write the same tokens (the report says whether they did). Times are end to
end (prefill included: what a caller waits for) and, separately, from each request's first
token to its last (the decode phase, the part speculation changes). Engines alternate within
each round; each reports its best of `repeats` rounds (a shared machine's slow rounds measure
its neighbours).
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Any

from tqdm import tqdm

from kvserve.bench.baselines import weights_read_seconds
from kvserve.bench.common import greedy_params
from kvserve.evals.factuality.grounded import make_table, prompt_for
from kvserve.workers.config import EngineConfig
from kvserve.workers.core.ngram_proposer import LookupCeiling, lookup_ceiling
from kvserve.workers.core.outputs import SpecDecodeStats
from kvserve.workers.engine import LLMEngine
from kvserve.workers.model_executor.loader import load_checkpoint

BATCH_SIZES = (1, 8)

_FUNCTIONS = [
    '''def moving_average(values, window):
    result = []
    total = 0
    for i in range(len(values)):
        total = total + values[i]
        if i >= window:
            total = total - values[i - window]
        if i >= window - 1:
            result.append(total / window)
    return result''',
    '''def parse_config(path):
    config = {}
    f = open(path)
    for line in f.readlines():
        line = line.strip()
        if line == "" or line.startswith("#"):
            continue
        key, value = line.split("=", 1)
        config[key.strip()] = value.strip()
    f.close()
    return config''',
    '''def find_duplicates(items):
    seen = []
    duplicates = []
    for item in items:
        if item in seen:
            if item not in duplicates:
                duplicates.append(item)
        else:
            seen.append(item)
    return duplicates''',
    '''def word_counts(text):
    counts = {}
    for word in text.lower().split():
        word = word.strip(".,;:!?")
        if word in counts:
            counts[word] = counts[word] + 1
        else:
            counts[word] = 1
    return counts''',
]

_CODE_TASKS = ["Rewrite this function with type hints and a docstring. Keep its logic and "
               "variable names as they are.",
               "Rewrite this function so that it uses descriptive comments. Change nothing "
               "else.",
               "Rename the function to snake_case with a `compute_` prefix and keep the rest "
               "of the code exactly as it is."]

_PASSAGES = [
    "The lighthouse at Corran Point was built in 1852 from granite quarried on the island "
    "itself. Its lamp burned whale oil until 1871, when it was converted to paraffin, and it "
    "was electrified in 1938. The last keeper, Margaret Doyle, left in 1991 when the light "
    "was automated. Today the keeper's cottage is a small museum, open from May to September, "
    "and the tower can be climbed on guided tours that run twice a day.",
    "The town council voted on Monday to close the old swimming pool on Mill Street at the "
    "end of the summer. The pool, which opened in 1964, needs repairs estimated at 2.3 "
    "million pounds. A new leisure centre with two pools, a gym and a climbing wall will open "
    "on the former bus depot site in 2027. Until then, residents can use the pool at Hollins "
    "School on weekday evenings and at weekends.",
    "Honeybees communicate the location of food through the waggle dance. A forager returning "
    "to the hive runs in a straight line while waggling its abdomen, then circles back and "
    "repeats. The angle of the run relative to vertical gives the direction of the food "
    "relative to the sun, and the duration of the waggle gives the distance: roughly one "
    "second for every kilometre. Other bees follow the dancer and then fly out to the source.",
    "The library's new opening hours start on the first of March. On weekdays it will open at "
    "eight in the morning and close at eight in the evening. On Saturdays it will open at ten "
    "and close at four. It will stay closed on Sundays and public holidays. Books can still be "
    "returned at any time through the drop box by the main entrance.",
]

_CHAT = ["Write a short story about a robot who learns to paint.",
         "What are some good habits for staying focused while studying?",
         "Describe your ideal weekend in a few sentences.",
         "Give me three ideas for a birthday party for a ten-year-old.",
         "Why is the sky blue? Explain it simply.",
         "Write a poem about autumn leaves.",
         "What should I pack for a week-long hiking trip?",
         "Suggest a name for a bakery and explain why it fits."]


def workloads() -> dict[str, list[list[dict[str, str]]]]:
    """Workload name -> chat conversations (8 each: a batch of 8, or 8 requests in a row)."""
    reports = [prompt_for(make_table(seed)) for seed in range(8)]
    code = [[{"role": "user", "content":
              f"{_CODE_TASKS[i % 3]}\n\n```python\n{_FUNCTIONS[i % 4]}\n```"}]
            for i in range(8)]
    quotes = [[{"role": "user", "content":
                f"Summarise this passage, quoting its key sentences word for word.\n\n"
                f"{_PASSAGES[i % 4]}"}] for i in range(8)]
    chat = [[{"role": "user", "content": c}] for c in _CHAT]
    return {"grounded_reports": reports, "code_edits": code, "quoting_summaries": quotes,
            "chat": chat}


INPUT_GROUNDED = ("grounded_reports", "code_edits", "quoting_summaries")


@dataclass
class Run:
    """One engine on one workload at one batch size (its best round)."""

    seconds: float  # all requests, end to end
    decode_seconds: float  # summed over requests: first token to last
    tokens: int
    steps: int
    outputs: list[list[int]]
    spec: SpecDecodeStats  # what this round's drafts did (zeros without speculation)

    @property
    def tok_s(self) -> float:
        return self.tokens / self.seconds

    def to_dict(self) -> dict[str, Any]:
        spec = self.spec
        return {"seconds": self.seconds, "output_tokens": self.tokens, "tok_s": self.tok_s,
                "decode_tok_s": self.decode_tok_s, "steps": self.steps,
                "acceptance_rate": spec.acceptance_rate,
                "mean_accepted_length": spec.mean_accepted_length,
                "draft_tokens": spec.num_draft_tokens,
                "accepted_tokens": spec.num_accepted_tokens}

    @property
    def decode_tok_s(self) -> float:
        """Tokens after the first, per second between first and last token."""
        return (self.tokens - len(self.outputs)) / self.decode_seconds


def _run_batch(engine: LLMEngine, conversations: list[list[dict[str, str]]], batch: int,
               output_len: int) -> Run:
    """The conversations `batch` at a time, greedy, to the end (EOS or output_len)."""
    before = dataclasses.replace(engine.spec_stats,
                                 accepted_per_position=list(engine.spec_stats.accepted_per_position))
    params = greedy_params(output_len, ignore_eos=False)
    outputs: list[list[int]] = []
    decode = steps = 0.0
    start = time.perf_counter()
    for i in range(0, len(conversations), batch):
        ids = [engine.add_request(messages=m, params=params) for m in conversations[i:i + batch]]
        got: dict[str, list[int]] = {rid: [] for rid in ids}
        first: dict[str, float] = {}
        while engine.has_unfinished():
            outs = engine.step()
            steps += 1
            now = time.perf_counter()
            for out in outs:
                first.setdefault(out.request_id, now)
                got[out.request_id] += out.token_ids
                if out.finished:
                    decode += now - first[out.request_id]
        outputs += [got[rid] for rid in ids]
    seconds = time.perf_counter() - start
    stats = engine.spec_stats
    spec = SpecDecodeStats(stats.num_drafts - before.num_drafts,
                           stats.num_draft_tokens - before.num_draft_tokens,
                           stats.num_accepted_tokens - before.num_accepted_tokens)
    return Run(seconds, decode, sum(map(len, outputs)), int(steps), outputs, spec)


def run_speculative_bench(config: EngineConfig, output_len: int = 128, repeats: int = 1,
                          batch_sizes: tuple[int, ...] = BATCH_SIZES, requests: int = 8,
                          progress: bool = True) -> dict[str, Any]:
    """Every workload (its first `requests` conversations) at every batch size, without and
    with speculation (`config`'s method, n-gram when it names none): output tok/s, their
    ratio, acceptance, identical outputs."""
    if config.speculative_method is None:
        config = dataclasses.replace(config, speculative_method="ngram")
    plain_config = dataclasses.replace(config, speculative_method=None)
    ckpt = load_checkpoint(config.model)
    engines = {"plain": LLMEngine(plain_config, checkpoint=ckpt),
               "speculative": LLMEngine(config, checkpoint=ckpt)}
    work = {name: convs[:requests] for name, convs in workloads().items()}
    for engine in engines.values():  # warm-up: kernels, oneDNN shapes, the prefill rate
        _run_batch(engine, work["chat"][:2], 2, 8)
    cells = [(name, b) for name in work for b in batch_sizes]
    bar = tqdm(total=len(cells) * repeats * 2, desc="bench speculative", disable=not progress,
               unit="run")
    results: dict[str, dict[int, dict[str, Run]]] = {}
    for name, batch in cells:
        best: dict[str, Run] = {}
        for _ in range(repeats):
            for label, engine in engines.items():
                run = _run_batch(engine, work[name], batch, output_len)
                if label not in best or run.seconds < best[label].seconds:
                    best[label] = run
                bar.update(1)
        results.setdefault(name, {})[batch] = best
    bar.close()
    read_ms = weights_read_seconds(engines["plain"].model) * 1000
    ceilings = {name: _lookup_ceiling(engines["plain"], work[name],
                                      next(iter(results[name].values()))["plain"].outputs,
                                      config.num_speculative_tokens) for name in work}
    return _report(results, config, output_len, read_ms, ceilings)


def _lookup_ceiling(engine: LLMEngine, conversations: list[list[dict[str, str]]],
                    outputs: list[list[int]], k: int) -> float:
    """Decode tokens per step that the best conceivable prompt-lookup proposer would reach on
    these greedy outputs (`lookup_ceiling`): at batch 1 no prompt-lookup proposer's decode
    speedup can exceed it, since a verifying step costs at least a plain one."""
    found = [lookup_ceiling(engine.tokenize(messages=m), out, k)
             for m, out in zip(conversations, outputs, strict=True)]
    return LookupCeiling(sum(c.decode_tokens for c in found),
                         sum(c.fewest_steps for c in found)).tokens_per_step


def _report(results: dict[str, dict[int, dict[str, Run]]], config: EngineConfig,
            output_len: int, read_ms: float, ceilings: dict[str, float]) -> dict[str, Any]:
    rows = []
    for name, by_batch in results.items():
        for batch, runs in by_batch.items():
            plain, spec = runs["plain"], runs["speculative"]
            rows.append({
                "workload": name, "input_grounded": name in INPUT_GROUNDED, "batch": batch,
                "plain": plain.to_dict(), "speculative": spec.to_dict(),
                "speedup": spec.tok_s / plain.tok_s,
                "decode_speedup": spec.decode_tok_s / plain.decode_tok_s,
                "outputs_identical": plain.outputs == spec.outputs,
                # batch 1: tokens per read of the weights (one per step without speculation)
                "tokens_per_step": spec.tokens / spec.steps,
                "spec_ms_per_step": spec.seconds * 1000 / spec.steps,
                # the most decode tokens per step any prompt-lookup proposer could write on
                # these outputs: at batch 1, a ceiling on its decode speedup
                "lookup_ceiling": ceilings[name],
            })
    report = {"rows": rows, "weights_read_ms": read_ms, "output_len": output_len,
              "speculative_method": config.speculative_method,
              "num_speculative_tokens": config.num_speculative_tokens,
              "prompt_lookup": [config.prompt_lookup_min, config.prompt_lookup_max],
              "outputs_identical": all(r["outputs_identical"] for r in rows)}
    report["summary"] = summarize(report)
    return report


def summarize(report: dict[str, Any]) -> str:
    lines = [f"speculative decoding: {report['speculative_method']}, "
             f"{report['num_speculative_tokens']} draft tokens, prompt lookup "
             f"{report['prompt_lookup'][0]}-{report['prompt_lookup'][1]}; greedy, up to "
             f"{report['output_len']} tokens; reading the weights once: "
             f"{report['weights_read_ms']:.1f} ms",
             f"{'workload':<18} {'batch':>5} {'plain tok/s':>11} {'spec tok/s':>10} "
             f"{'speedup':>7} {'decode x':>8} {'ceiling':>7} {'accept':>6} {'mean len':>8} "
             f"{'same':>5}"]
    for r in report["rows"]:
        s = r["speculative"]
        ceiling = f"{r['lookup_ceiling']:.2f}x" if r["batch"] == 1 else "-"  # a bound at 1
        rate = s["acceptance_rate"]
        mean = s["mean_accepted_length"]
        lines.append(
            f"{r['workload']:<18} {r['batch']:>5} {r['plain']['tok_s']:>11.1f} "
            f"{s['tok_s']:>10.1f} {r['speedup']:>6.2f}x {r['decode_speedup']:>7.2f}x "
            f"{ceiling:>7} "
            f"{'-' if rate is None else f'{rate:.2f}':>6} "
            f"{'-' if mean is None else f'{mean:.2f}':>8} "
            f"{'yes' if r['outputs_identical'] else 'NO':>5}")
    lines.append("speedup: output tok/s end to end (prefill included); decode x: from each "
                 "request's first token to its last; ceiling: decode tokens per step of the "
                 "best conceivable prompt-lookup proposer on these outputs (at batch 1 no "
                 "prompt-lookup proposer's decode x exceeds it); accept: accepted / draft "
                 "tokens; mean len: tokens a verifying step emits per request")
    return "\n".join(lines)
