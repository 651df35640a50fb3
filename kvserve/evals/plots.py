"""PNG plots for eval reports (matplotlib's Agg backend: no display needed)."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402 - after choosing the backend


def heatmap(path: Path, title: str, lengths: list[int], depths: list[float],
            scores: dict[tuple[int, float], float]) -> Path:
    """Score (0-100) per (length, depth) cell: depth down, length across, like RULER's."""
    grid = [[scores.get((n, d), float("nan")) for n in lengths] for d in depths]
    fig, ax = plt.subplots(figsize=(1.2 * len(lengths) + 2.5, 0.6 * len(depths) + 2))
    image = ax.imshow(grid, vmin=0, vmax=100, cmap="RdYlGn", aspect="auto")
    ax.set_xticks(range(len(lengths)), [_tokens(n) for n in lengths])
    ax.set_yticks(range(len(depths)), [f"{d:g}%" for d in depths])
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("needle depth")
    for i, row in enumerate(grid):
        for j, value in enumerate(row):
            if value == value:  # not NaN
                ax.text(j, i, f"{value:.0f}", ha="center", va="center", fontsize=8)
    fig.colorbar(image, ax=ax, label="score")
    ax.set_title(title)
    return _save(fig, path)


def lines(path: Path, title: str, xlabel: str, ylabel: str,
          series: dict[str, list[tuple[float, float]]], vline: float | None = None,
          vline_label: str = "", threshold: float | None = None) -> Path:
    """One line per series of (x, y) points; optional vertical marker and horizontal threshold."""
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, points in series.items():
        xs, ys = zip(*sorted(points), strict=True) if points else ((), ())
        ax.plot(xs, ys, marker="o", label=name)
    if vline is not None:
        ax.axvline(vline, color="grey", linestyle="--", label=vline_label)
    if threshold is not None:
        ax.axhline(threshold, color="red", linestyle=":", label=f"threshold {threshold:g}")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    return _save(fig, path)


def _tokens(n: int) -> str:
    """4096 -> 4k (the CLI's k is 1,024 tokens), 1500 -> 1500."""
    return f"{n // 1024}k" if n >= 1024 and n % 1024 == 0 else str(n)


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def error_bars(path: Path, title: str, ylabel: str, labels: list[str],
               series: dict[str, list[tuple[float, float, float]]]) -> Path:
    """One line per series over categorical `labels`; points are (value, ci_low, ci_high)."""
    fig, ax = plt.subplots(figsize=(max(6, 1.3 * len(labels) + 3), 4.5))
    for offset, (name, points) in enumerate(series.items()):
        xs = [i + 0.06 * (offset - (len(series) - 1) / 2) for i in range(len(points))]
        values = [p[0] for p in points]
        errors = [[v - p[1] for v, p in zip(values, points, strict=True)],
                  [p[2] - v for v, p in zip(values, points, strict=True)]]
        ax.errorbar(xs, values, yerr=errors, marker="o", capsize=4, label=name)
    ax.set_xticks(range(len(labels)), labels, rotation=20 if len(labels) > 4 else 0)
    ax.set_ylabel(ylabel)
    ax.set_ylim(0, 1)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    return _save(fig, path)
