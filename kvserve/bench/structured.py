"""`kvserve bench structured`: output tokens/s with a JSON schema against unconstrained, at
batch 1 and 32, in one run, and what the mask itself costs per step.

Both modes run the same chats on one engine, greedy, for exactly `output_len` tokens: the
unconstrained requests ignore EOS, and the schema (`LONG_SCHEMA`, a list of at least 1,000
person records) cannot close within the run, so every request emits `output_len` tokens in
both modes and the batches are the same size at every step. The difference is then what a
constraint costs: filling each row's bitmask on the host and applying it to the logits,
reported per step (`mask_ms_per_step`). Modes alternate within each round; each reports its
best of `repeats` rounds (a shared machine's slow rounds measure its neighbours).

`SCHEMAS` and `PROMPTS` are also the acceptance cases of the tests: five schemas (nested
objects, arrays, enums, required fields, numbers), six prompts each, which SmolLM2 answers in
prose unless constrained.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from tqdm import tqdm

from kvserve.bench.baselines import weights_read_seconds
from kvserve.bench.common import best_of_alternating, greedy_params
from kvserve.workers.config import EngineConfig
from kvserve.workers.engine import LLMEngine

BATCH_SIZES = (1, 32)

SCHEMAS: dict[str, dict[str, Any]] = {
    "person": {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 24},
                       "age": {"type": "integer", "minimum": 0, "maximum": 120}},
        "required": ["name", "age"], "additionalProperties": False},
    "city": {  # a nested object
        "type": "object",
        "properties": {"city": {
            "type": "object",
            "properties": {"name": {"type": "string", "maxLength": 24},
                           "country": {"type": "string", "maxLength": 24}},
            "required": ["name", "country"], "additionalProperties": False},
            "population_millions": {"type": "integer", "minimum": 0, "maximum": 100}},
        "required": ["city", "population_millions"], "additionalProperties": False},
    "tags": {  # an array
        "type": "object",
        "properties": {"topic": {"type": "string", "maxLength": 20},
                       "tags": {"type": "array", "items": {"type": "string", "maxLength": 12},
                                "minItems": 1, "maxItems": 3}},
        "required": ["topic", "tags"], "additionalProperties": False},
    "review": {  # an enum and a bounded number
        "type": "object",
        "properties": {"sentiment": {"enum": ["positive", "negative", "neutral"]},
                       "score": {"type": "number", "minimum": 0, "maximum": 1}},
        "required": ["sentiment", "score"], "additionalProperties": False},
    "book": {  # required fields of three types
        "type": "object",
        "properties": {"title": {"type": "string", "maxLength": 30},
                       "year": {"type": "integer", "minimum": 1000, "maximum": 2100},
                       "fiction": {"type": "boolean"}},
        "required": ["title", "year", "fiction"], "additionalProperties": False},
}

PROMPTS: dict[str, list[str]] = {
    "person": ["Tell me about a famous scientist.", "Who wrote Hamlet?",
               "Describe your best friend.", "Who was the first person on the Moon?",
               "Introduce a fictional detective.", "Tell me about a painter you like."],
    "city": ["Tell me about Paris.", "What is the capital of Japan?",
             "Describe a city by the sea.", "Which city is the largest in Brazil?",
             "Tell me about a city in Canada.", "What do you know about Cairo?"],
    "tags": ["Write about gardening.", "What is machine learning?",
             "Explain how bread is made.", "Talk about the ocean.",
             "What is jazz?", "Describe a mountain hike."],
    "review": ["The food was cold and the waiter was rude.", "I loved this movie!",
               "The hotel was fine, nothing special.", "Best purchase I ever made.",
               "The battery died after two days.", "It arrived on time."],
    "book": ["Recommend a novel.", "What is a classic book about whales?",
             "Tell me about a book on physics.", "Which book should a child read first?",
             "Name a famous poem collection.", "What is your favourite science fiction book?"],
}

LONG_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"records": {
        "type": "array", "minItems": 1000,
        "items": {"type": "object",
                  "properties": {"name": {"type": "string", "maxLength": 16},
                                 "age": {"type": "integer", "minimum": 0}},
                  "required": ["name", "age"], "additionalProperties": False}}},
    "required": ["records"], "additionalProperties": False}


def cases() -> list[tuple[str, str]]:
    """(schema name, prompt): 30 in all, six per schema."""
    return [(name, prompt) for name, prompts in PROMPTS.items() for prompt in prompts]


@dataclass
class Run:
    seconds: float
    tokens: int
    steps: int
    mask_seconds: float
    masked_rows: int

    @property
    def tok_s(self) -> float:
        return self.tokens / self.seconds

    def to_dict(self) -> dict[str, Any]:
        return {"seconds": self.seconds, "output_tokens": self.tokens, "tok_s": self.tok_s,
                "steps": self.steps,
                "mask_ms_per_step": 1000 * self.mask_seconds / self.steps,
                "mask_share": self.mask_seconds / self.seconds,
                "masked_rows": self.masked_rows}


def _run(engine: LLMEngine, batch: int, output_len: int, constrained: bool) -> Run:
    """`batch` requests side by side, each `output_len` tokens."""
    extra = {"structured_outputs": {"json": LONG_SCHEMA}} if constrained else {}
    params = greedy_params(output_len, ignore_eos=not constrained, **extra)
    chats = [[{"role": "user", "content": f"List {10 + i} people with their ages as JSON."}]
             for i in range(batch)]
    if constrained:  # compiled once, before the clock (as the async engine does off the loop)
        engine.compile_grammar(params)
    mask_s, masked, steps = engine.structured.mask_seconds, engine.structured.masked_rows, 0
    start = time.perf_counter()
    for chat in chats:
        engine.add_request(messages=chat, params=params)
    tokens = 0
    while engine.has_unfinished():
        for out in engine.step():
            tokens += len(out.token_ids)
        steps += 1
    seconds = time.perf_counter() - start
    return Run(seconds, tokens, steps, engine.structured.mask_seconds - mask_s,
               engine.structured.masked_rows - masked)


def run_structured_bench(config: EngineConfig, output_len: int = 64, repeats: int = 2,
                         batch_sizes: tuple[int, ...] = BATCH_SIZES, progress: bool = True
                         ) -> dict[str, Any]:
    """Unconstrained and JSON-schema runs at each batch size: tok/s, their ratio, the mask's
    time per step; batch 1's ms/token beside the time to read the weights once."""
    engine = LLMEngine(config)
    _run(engine, 2, 4, False)  # warm-up: kernels, oneDNN shapes, the prefill rate
    _run(engine, 2, 4, True)
    bar = tqdm(total=len(batch_sizes) * repeats * 2, desc="bench structured", unit="run",
               disable=not progress)
    rows = []
    for batch in batch_sizes:
        best = best_of_alternating(
            (False, True), repeats,
            lambda constrained, batch=batch: _run(engine, batch, output_len, constrained),
            lambda run: run.seconds, bar.update)
        plain, schema = best[False], best[True]
        rows.append({"batch": batch, "unconstrained": plain.to_dict(),
                     "json_schema": schema.to_dict(), "ratio": schema.tok_s / plain.tok_s})
    bar.close()
    read_ms = weights_read_seconds(engine.model) * 1000
    return _report(rows, engine, output_len, read_ms)


def _report(rows: list[dict[str, Any]], engine: LLMEngine, output_len: int,
            read_ms: float) -> dict[str, Any]:
    lines = [f"bench structured: {engine.info.name}, {engine.info.dtype} on "
             f"{engine.info.device}, {output_len} output tokens per request, greedy",
             "batch  unconstrained tok/s  json_schema tok/s  ratio  mask ms/step  mask share"]
    for r in rows:
        u, s = r["unconstrained"], r["json_schema"]
        lines.append(f"{r['batch']:>5}  {u['tok_s']:>19.1f}  {s['tok_s']:>17.1f}  "
                     f"{r['ratio']:>5.2f}  {s['mask_ms_per_step']:>12.3f}  "
                     f"{100 * s['mask_share']:>9.1f}%")
    one = next((r for r in rows if r["batch"] == 1), None)
    if one is not None:
        ms = 1000 / one["json_schema"]["tok_s"]
        lines.append(f"batch 1 with the schema: {ms:.1f} ms/token, {ms / read_ms:.2f}x the time "
                     f"to read the weights once ({read_ms:.1f} ms)")
    return {"rows": rows, "output_len": output_len, "weights_read_ms": read_ms,
            "model": engine.info.name, "dtype": engine.info.dtype,
            "device": engine.info.device, "summary": "\n".join(lines)}
