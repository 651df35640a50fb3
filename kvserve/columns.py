"""Plain-text tables for terminals: rows of cells, each column as wide as its widest cell.

Here, outside the layers, because the CLI (`kvserve status`, `kvserve models`) and the
benchmarks (`kvserve bench gpu-compile`) print them, and this needs nothing (no torch)."""

from __future__ import annotations

from collections.abc import Sequence


def aligned(rows: Sequence[Sequence[str]]) -> list[str]:
    """Each row as one line, cells left-aligned in columns two spaces apart."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return ["  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip()
            for row in rows]
