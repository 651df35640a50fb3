"""What the benchmarks share (kvserve/bench/common.py): the best-of-rounds loop."""

from __future__ import annotations

from kvserve.bench.common import best_of_alternating


def test_modes_take_turns_reversed_every_other_round_and_each_keeps_its_fastest_run():
    """Negative control within: the slowest run of a mode is never the one kept, and a loop
    that ran the modes in the same order every round would give a different call order."""
    seconds = iter([3.0, 5.0, 1.0, 4.0, 2.0, 6.0])  # a, b | b, a | a, b
    calls: list[str] = []
    ticks: list[int] = []

    def run(mode: str) -> tuple[str, float]:
        calls.append(mode)
        return mode, next(seconds)

    best = best_of_alternating(("a", "b"), 3, run, lambda r: r[1],
                               lambda: ticks.append(1))
    assert calls == ["a", "b", "b", "a", "a", "b"]
    assert best == {"a": ("a", 2.0), "b": ("b", 1.0)}
    assert len(ticks) == 6
