"""Confidence intervals shared by every eval's report."""

from __future__ import annotations

import math

Z_95 = 1.959963984540054  # two-sided 95 %


def wilson_interval(successes: float, n: int, z: float = Z_95) -> tuple[float, float]:
    """Wilson score interval for a proportion `successes / n` (fractional successes allowed,
    e.g. a mean of per-sample scores times n). (0, 1) when n == 0: nothing is known."""
    if n <= 0:
        return 0.0, 1.0
    p = min(max(successes / n, 0.0), 1.0)
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    return max(0.0, centre - half), min(1.0, centre + half)


def stderr(values: list[float]) -> float:
    """Standard error of the mean (lm-evaluation-harness's `_stderr` fields); 0 below 2 values."""
    n = len(values)
    if n < 2:
        return 0.0
    mean = sum(values) / n
    return math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1) / n)
