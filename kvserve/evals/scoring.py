"""Scoring of long-context recall answers, as RULER defines it, and per-cell summaries.

* `string_match_all`: per sample, the fraction of expected values found in the answer
  (case-insensitive substring), RULER's metric for the niah tasks.
* `string_match_part`: 1.0 if any one expected value is found, else 0.0 (RULER's QA metric).
* `passkey_match`: the Landmark-Attention passkey check, whether the first number in the
  answer is the pass key.

Substring matching is RULER's and deliberately lenient: "1234567" is found in "12345678" and
in "id-1234567x". `passkey_match` is stricter: only the first number counts. Numbers are runs
of ASCII digits; a comma-grouped number ("12,345", groups of three) counts as its digits
("12345"), a decimal ("12345.6") is a different number, a sign is ignored, and digits are
compared as written (so "012345" is not 12345).

Every cell (task x length x depth) reports the mean of its per-sample scores with a 95%
Wilson interval (`kvserve.evals.stats.wilson_interval`, fractional successes = mean x n) and the
standard error of the mean.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence

from kvserve.evals.stats import stderr, wilson_interval

# The metrics each task reports, in report order.
TASK_METRICS = {
    "passkey": ("passkey_match", "string_match_all", "string_match_part"),
    "niah_single": ("string_match_all", "string_match_part"),
    "niah_multikey": ("string_match_all", "string_match_part"),
    "niah_multivalue": ("string_match_all", "string_match_part"),
    "niah_multiquery": ("string_match_all", "string_match_part"),
}

# A number: comma-grouped thousands or a plain digit run, with an optional decimal part.
_NUMBER = re.compile(r"[0-9]{1,3}(?:,[0-9]{3})+(?![0-9])(?:\.[0-9]+)?|[0-9]+(?:\.[0-9]+)?")
_CONTROL = re.compile(r"[\x00-\x1f]")


def _clean(prediction: str) -> str:
    """RULER's postprocess_pred: control characters become newlines, ends are stripped."""
    return _CONTROL.sub("\n", prediction.strip())


def string_match_all(prediction: str, targets: Sequence[str]) -> float:
    """Fraction of `targets` found in `prediction` (case-insensitive substring)."""
    if not targets:
        raise ValueError("no targets to match")
    answer = _clean(prediction).lower()
    return sum(t.lower() in answer for t in targets) / len(targets)


def string_match_part(prediction: str, targets: Sequence[str]) -> float:
    """1.0 if any of `targets` is found in `prediction` (case-insensitive substring), else 0.0."""
    if not targets:
        raise ValueError("no targets to match")
    answer = _clean(prediction).lower()
    return float(any(t.lower() in answer for t in targets))


def first_number(text: str) -> str | None:
    """The first number in `text` as written, thousands commas removed; None if there is none."""
    m = _NUMBER.search(text)
    return m.group(0).replace(",", "") if m else None


def passkey_match(prediction: str, target: str) -> float:
    """1.0 if the first number in `prediction` is the pass key `target`, else 0.0."""
    return float(first_number(_clean(prediction)) == target.strip())


def score_sample(task: str, prediction: str, targets: Sequence[str]) -> dict[str, float]:
    """Every metric `task` reports (see TASK_METRICS) for one answer."""
    if task not in TASK_METRICS:
        raise ValueError(f"unknown task {task!r}; expected one of {tuple(TASK_METRICS)}")
    scores = {
        "string_match_all": string_match_all(prediction, targets),
        "string_match_part": string_match_part(prediction, targets),
    }
    if task == "passkey":
        scores["passkey_match"] = passkey_match(prediction, targets[0])
    return {name: scores[name] for name in TASK_METRICS[task]}


def summarize_cell(scores: Sequence[float]) -> dict[str, float | int]:
    """Mean, n, 95% Wilson interval (ci_low, ci_high) and standard error of one cell's
    per-sample scores (each within [0, 1]). An empty cell has mean NaN and interval (0, 1)."""
    n = len(scores)
    mean = sum(scores) / n if n else math.nan
    low, high = wilson_interval(sum(scores), n)
    return {"mean": mean, "n": n, "ci_low": low, "ci_high": high,
            "stderr": stderr(list(scores))}
