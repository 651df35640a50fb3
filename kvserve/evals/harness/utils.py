"""The task's scoring, for lm-evaluation-harness (`process_results: !function utils...`) and
kvserve/evals/harness/compare.py alike: pure Python, since it runs inside lm-eval's own
environment."""

from __future__ import annotations

import re
import string


def normalise(text: str) -> str:
    """Lower case, no punctuation, single spaces."""
    text = text.lower().translate(str.maketrans("", "", string.punctuation))
    return re.sub(r"\s+", " ", text).strip()


def contains_answer(response: str, answers: list[str]) -> bool:
    """Whether any accepted answer appears in the response as whole words ("The capital of
    France is Paris." answers "Paris"; "Parisian" does not)."""
    said = f" {normalise(response)} "
    return any(f" {normalise(a)} " in said for a in answers)


def process_results(doc: dict, results: list[str]) -> dict[str, float]:
    return {"contains_answer": float(contains_answer(results[0], doc["answers"]))}
