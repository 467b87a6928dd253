"""Shared by the benchmark scripts: matplotlib's pyplot with a file-only backend, or None
(with a note on stderr) where matplotlib is missing, so a benchmark never fails on its plot."""

from __future__ import annotations

import sys


def pyplot_or_none(tag: str = "bench"):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception as exc:  # noqa: BLE001 - any import problem means: no plot
        print(f"[{tag}] matplotlib unavailable, no plot: {exc}", file=sys.stderr)
        return None
    return plt
