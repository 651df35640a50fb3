"""The load-test baseline: one row per user count, as a Markdown table and a PNG plot.

The plot shows output tokens/s and TTFT p50/p99 against users and marks the first user count
at which admission control refused requests (RESOURCE_EXHAUSTED).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from kvserve.bench.loadtest import REFUSED, LoadtestSummary


def first_refusing(summaries: Sequence[LoadtestSummary]) -> int | None:
    """The smallest user count at which some request was refused, if any was."""
    counts = [s.users for s in summaries if s.failures.get(REFUSED, 0) > 0]
    return min(counts) if counts else None


def baseline_table(summaries: Sequence[LoadtestSummary]) -> str:
    def ms(value: float | None) -> str:
        return "-" if value is None else f"{value:.0f}"

    rows = ["| users | streams/s | output tok/s | TTFT p50 ms | TTFT p99 ms | ITL p50 ms | "
            "ITL p99 ms | refused | refusal p99 ms | other failures |",
            "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for s in sorted(summaries, key=lambda s: s.users):
        refused = s.failures.get(REFUSED, 0)
        other = ", ".join(f"{k}={v}" for k, v in sorted(s.failures.items()) if k != REFUSED)
        refusal_ms = s.failure_latency_ms.get(REFUSED, {}).get("p99")
        rows.append(f"| {s.users} | {s.requests_per_s:.2f} | {s.output_tokens_per_s:.1f} | "
                    f"{ms(s.ttft_p50_ms)} | {ms(s.ttft_p99_ms)} | {ms(s.itl_p50_ms)} | "
                    f"{ms(s.itl_p99_ms)} | {refused} | {ms(refusal_ms)} | {other or 'none'} |")
    return "\n".join(rows)


def plot_baseline(summaries: Sequence[LoadtestSummary], path: Path, title: str) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    points = sorted(summaries, key=lambda s: s.users)
    users = [s.users for s in points]
    fig, (tps, ttft) = plt.subplots(1, 2, figsize=(11, 4.2))
    tps.plot(users, [s.output_tokens_per_s for s in points], "o-", label="output tokens/s")
    tps.set_ylabel("output tokens/s")
    ttft.plot(users, [_seconds(s.ttft_p50_ms) for s in points], "o-", label="TTFT p50")
    ttft.plot(users, [_seconds(s.ttft_p99_ms) for s in points], "s--", label="TTFT p99")
    ttft.set_ylabel("time to first token (s)")
    refusing = first_refusing(points)
    for ax in (tps, ttft):
        ax.set_xscale("log", base=2)
        ax.set_xticks(users, [str(u) for u in users])
        ax.set_xlabel("concurrent users")
        ax.grid(alpha=0.3)
        if refusing is not None:
            ax.axvline(refusing, color="tab:red", linestyle=":",
                       label=f"admission control refuses from {refusing} users")
        ax.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _seconds(ms: float | None) -> float:
    return float("nan") if ms is None else ms / 1000
