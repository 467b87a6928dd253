"""Shared by the benchmark scripts: the provenance every result file carries, writing a
run's results (JSON, markdown table, plot), and matplotlib's pyplot with a file-only
backend, or None (with a note on stderr) where matplotlib is missing, so a benchmark
never fails on its plot."""

from __future__ import annotations

import datetime as dt
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Callable

import torch


def source_commit() -> str | None:
    """``$BENCH_COMMIT`` where set (a copied tree, as on the GPU machine, whose ``.git`` may be
    missing or stale), else the checkout's ``git rev-parse --short HEAD`` (``+dirty`` where tracked
    files differ from it), else None."""
    if os.environ.get("BENCH_COMMIT"):
        return os.environ["BENCH_COMMIT"]
    here = Path(__file__).resolve().parent
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=here, capture_output=True, text=True,
                                timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=here,
                               capture_output=True, text=True, timeout=10, check=True).stdout.strip()
        return commit + ("+dirty" if dirty else "")
    except Exception:  # noqa: BLE001 - no git, not a checkout
        return None


def run_header(device: str) -> dict:
    """Device name, date, command line (with the FLASHSAMPLING_* knobs it ran under), source
    commit and torch version of this run."""
    knobs = [f"{k}={v}" for k, v in sorted(os.environ.items()) if k.startswith("FLASHSAMPLING_")]
    return {
        "device": device,
        "date": dt.date.today().isoformat(),
        "command": " ".join(knobs + ["python"] + sys.argv),
        "commit": source_commit(),
        "torch": torch.__version__,
    }


def write_results(out: str | Path, stem: str, results: dict, table: str,
                  plot: Callable[[dict, Path], None] | None = None) -> Path:
    """Writes <out>/<stem>.json (results), .md (the command, then the table) and, with
    `plot`, .png; returns <out>/<stem>."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.json").write_text(json.dumps(results, indent=1))
    commit = f" (commit {results['commit']})" if results.get("commit") else ""
    (out / f"{stem}.md").write_text(f"Command: `{results['command']}`{commit}\n\n{table.lstrip(chr(10))}\n")
    if plot is not None:
        (out / f"{stem}.png").unlink(missing_ok=True)  # a plot of an earlier run would look like this one's
        plot(results, out / f"{stem}.png")
    return out / stem


def written_files(stem: Path) -> str:
    """The files :func:`write_results` wrote for ``stem``, for the log line."""
    return ", ".join(str(stem.with_name(f"{stem.name}.{ext}")) for ext in ("json", "md", "png")
                     if stem.with_name(f"{stem.name}.{ext}").exists())


def pyplot_or_none(tag: str = "bench"):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception as exc:  # noqa: BLE001 - any import problem means: no plot
        print(f"[{tag}] matplotlib unavailable, no plot: {exc}", file=sys.stderr)
        return None
    return plt
