"""Shared by the serving-feature benchmarks (bench_logprobs.py, bench_penalties.py,
bench_speculative.py): their common arguments, the device and its timer, torch baselines
compiled where torch.compile works (else run eagerly, and recorded so), FlashInfer's sampling
module or the reason it is missing, contenders that fail without ending the run (the error goes
into the record), results rewritten after every record (a run cut short keeps what it measured) or
added to an earlier run's file (--append), the target check lines, the markdown tables and a plot of
ratios against the batch size.

``python benchmarks/harness.py FILE.json ...`` rewrites the .md and .png beside such a run's
records (the device tool brings back only a few files a call: benchmarks/device_run.sh's
``serving`` step keeps the .json).

Timing: on CUDA, medians of CUDA-graph replays (``bench_sampler.median_us``); ``--timing eager``
(the default of ``--tiny`` and the only choice on the CPU) times eager calls, host work included.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Callable, Iterable

import torch

from bench_sampler import median_us
from flashsampling_cuda.problems import lm_head_weight
from report import pyplot_or_none, run_header, write_results


def int_list(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def shape_list(text: str) -> list[tuple[int, int]]:
    """``"4096x151936,8192x128256"`` -> ``[(4096, 151936), (8192, 128256)]`` (D x V)."""
    return [tuple(int(x) for x in s.lower().split("x")) for s in text.split(",") if s.strip()]


def add_problem_arguments(parser: argparse.ArgumentParser, shapes: str, batches: str, regimes: str) -> None:
    """--shapes, --batches and --regimes, the comma lists lm_head_problems takes, with these defaults."""
    parser.add_argument("--shapes", default=shapes)
    parser.add_argument("--batches", default=batches)
    parser.add_argument("--regimes", default=regimes)


def lm_head_problems(shapes: str, regimes: str, batches: str):
    """The grid of an A/B probe: for each shape (``shape_list``), logits regime and batch (comma
    lists), yields (D, V, regime, B, weight, hidden), the weight made once a shape on the GPU
    (flashsampling_cuda/problems.py's weights and hidden rows); the generator drops its own
    reference before the next shape's, though a caller still holding the last cell's keeps it."""
    from flashsampling_cuda.problems import hidden_states, lm_head_weight

    for dim, vocab in shape_list(shapes):
        weight = lm_head_weight(vocab, dim)
        for regime in regimes.split(","):
            for batch in (int(b) for b in batches.split(",")):
                yield dim, vocab, regime, batch, weight, hidden_states(weight, batch, regime, seed=batch)
        del weight


def parse_arguments(parser: argparse.ArgumentParser, tiny: dict) -> argparse.Namespace:
    """The arguments, with ``tiny``'s values (argument dest -> value) as the defaults under --tiny."""
    args = parser.parse_args()
    if args.tiny:
        parser.set_defaults(**tiny)
        args = parser.parse_args()
    return args


def tiny_help(tiny: dict) -> str:
    return " ".join(f"--{k.replace('_', '-')} {v}" for k, v in tiny.items())


def make_parser(doc: str, *, shapes: str, batches: str, tiny: dict) -> argparse.ArgumentParser:
    """The arguments every serving benchmark takes; ``tiny``: the defaults under --tiny."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default=shapes, help="comma list of DxV")
    parser.add_argument("--batches", default=batches, help="comma list of batch sizes")
    parser.add_argument("--temperature", type=float, default=0.8)
    parser.add_argument("--timing", choices=["graph", "eager"], default=None,
                        help="CUDA-graph replays (default on CUDA) or eager calls (default with --tiny and on the CPU)")
    parser.add_argument("--no-compile", action="store_true", help="run the torch baselines eagerly (recorded)")
    parser.add_argument("--no-flashinfer", action="store_true", help="leave FlashInfer out (recorded)")
    parser.add_argument("--cpu", action="store_true", help="run on the CPU even where a GPU is")
    parser.add_argument("--tiny", action="store_true", help=f"smoke run on whatever device is there, defaults "
                        f"{tiny_help(tiny)}; eager timing, nothing written unless --out is given")
    parser.add_argument("--append", action="store_true",
                        help="add to this benchmark's result file of the same device and date, replacing the "
                        "records of the shapes this run measures (e.g. one shape per call)")
    parser.add_argument("--out", default=None,
                        help="results folder (default benchmarks/results; with --tiny only where given)")
    return parser


def short_error(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}".strip().replace("\n", " ")
    return text if len(text) <= 400 else text[:400] + " ..."


class Baseline:
    """A torch baseline, ``torch.compile(fn, dynamic=False)`` where the run compiles. An error of
    a compiled call outside a CUDA-graph capture is taken as torch.compile failing: it is recorded
    in the results' ``compile.failed`` and the baseline runs eagerly from then on (each record
    says per baseline whether it ran compiled)."""

    def __init__(self, bench: "Bench", name: str, fn: Callable):
        self.bench, self.name, self.fn = bench, name, fn
        self.compiled_fn = torch.compile(fn, dynamic=False) if bench.compile_enabled else None

    @property
    def is_compiled(self) -> bool:
        return self.compiled_fn is not None

    def __call__(self, *args):
        if self.compiled_fn is not None:
            try:
                return self.compiled_fn(*args)
            except Exception as exc:  # noqa: BLE001 - recorded; the eager function runs instead
                if (self.bench.on_gpu and torch.cuda.is_current_stream_capturing()) or isinstance(
                        exc, torch.OutOfMemoryError):
                    raise  # not a compile failure: the eager function would fail the same way
                self.bench.results["compile"]["failed"][self.name] = short_error(exc)
                print(f"[bench] torch.compile failed for {self.name}, eager from now on: {short_error(exc)}",
                      file=sys.stderr, flush=True)
                self.compiled_fn = None
        return self.fn(*args)


def main(name: str, parser: argparse.ArgumentParser, tiny: dict, run: Callable[["Bench", argparse.Namespace], None],
         table: Callable[[dict], str], checks: Callable[[dict], list[str]], plot: Callable[[dict, Path], None],
         header: Callable[[argparse.Namespace], dict] = lambda args: {}) -> None:
    """A benchmark's whole run: parse the arguments, run it, write and print the results."""
    args = parse_arguments(parser, tiny)
    bench = Bench(name, args, **header(args))
    run(bench, args)
    bench.finish(table, checks, plot)


class Bench:
    """One run of a benchmark: device, timer, optional pieces, records and their files."""

    def __init__(self, name: str, args: argparse.Namespace, **header):
        self.name, self.args = name, args
        self.device = torch.device("cuda" if torch.cuda.is_available() and not args.cpu else "cpu")
        self.on_gpu = self.device.type == "cuda"
        self.timing = args.timing or ("graph" if self.on_gpu and not args.tiny else "eager")
        if self.timing == "graph" and not self.on_gpu:
            sys.exit(f"{name}: --timing graph needs a CUDA GPU")
        self.dtype = torch.bfloat16
        if not self.on_gpu and args.tiny:
            torch.set_num_threads(1)  # a smoke run: one thread is steadier on small, busy CI machines
        device_name = torch.cuda.get_device_name(self.device) if self.on_gpu else "CPU"
        compile_reason = None
        if args.no_compile:
            compile_reason = "--no-compile"
        elif not self.on_gpu:
            compile_reason = "CPU run: the baselines run eagerly"
        else:
            try:
                from torch.utils._triton import has_triton

                if not has_triton():
                    compile_reason = "Triton not available"
            except Exception as exc:  # noqa: BLE001 - recorded
                compile_reason = f"cannot tell whether Triton works: {short_error(exc)}"
        self.compile_enabled = compile_reason is None
        if self.compile_enabled:
            # One graph per (function, shape): more than dynamo's default of 8 recompiles per
            # function, past which it would silently run the baselines eagerly.
            torch._dynamo.config.recompile_limit = 256
            torch._dynamo.config.accumulated_recompile_limit = 4096
        self.flashinfer, fi_info = self._import_flashinfer()
        self.results = {
            **run_header(device_name),
            "benchmark": name,
            "dtype": "bf16",  # self.dtype
            "timing": self.timing,
            "tiny": bool(args.tiny),
            "temperature": args.temperature,
            "compile": {"enabled": self.compile_enabled, "reason": compile_reason, "failed": {}},
            "flashinfer": fi_info,
            **header,
            "records": [],
        }
        self.out = args.out or (None if args.tiny else "benchmarks/results")
        self.stem = f"{name}_{device_name.replace(' ', '_')}_{self.results['date']}" + ("_tiny" if args.tiny else "")
        self.previous = None
        if args.append and self.out and (Path(self.out) / f"{self.stem}.json").exists():
            self.previous = json.loads((Path(self.out) / f"{self.stem}.json").read_text())
            self.results["command"] = f"{self.previous['command']} ; {self.results['command']}"
            self.results["earlier_runs"] = self.previous.get("earlier_runs", []) + [
                {k: v for k, v in self.previous.items() if k not in ("records", "earlier_runs", "checks")}]
        print(f"[bench] {name} on {device_name}: timing {self.timing}, torch.compile "
              f"{'on' if self.compile_enabled else 'off (' + compile_reason + ')'}, FlashInfer "
              f"{fi_info.get('version') if fi_info['available'] else 'off (' + fi_info['reason'] + ')'}",
              file=sys.stderr, flush=True)

    def _import_flashinfer(self):
        if self.args.no_flashinfer:
            return None, {"available": False, "reason": "--no-flashinfer"}
        if not self.on_gpu:
            return None, {"available": False, "reason": "FlashInfer samples on CUDA only"}
        try:
            import flashinfer
            import flashinfer.sampling as fi
        except Exception as exc:  # noqa: BLE001 - FlashInfer is optional
            return None, {"available": False, "reason": f"not importable: {short_error(exc)}"}
        return fi, {"available": True, "version": getattr(flashinfer, "__version__", "?")}

    def baseline(self, name: str, fn: Callable) -> Baseline:
        return Baseline(self, name, fn)

    def time_us(self, fn: Callable) -> float:
        if self.on_gpu:
            if self.args.tiny:
                return median_us(fn, warmup=2, reps=5, graph=self.timing == "graph")
            return median_us(fn, graph=self.timing == "graph")
        fn()
        times = []
        for _ in range(3 if self.args.tiny else 10):
            start = time.perf_counter()
            fn()
            times.append((time.perf_counter() - start) * 1e6)
        return statistics.median(times)

    def measure(self, record: dict, key: str, fn: Callable, *args) -> float | None:
        """Times ``fn(*args)`` into ``record[key]`` (µs); an error goes to ``record["errors"][key]``
        and returns None. A :class:`Baseline` also notes whether it ran compiled."""
        try:
            us = self.time_us(lambda: fn(*args))
        except Exception as exc:  # noqa: BLE001 - report and keep going
            record.setdefault("errors", {})[key] = short_error(exc)
            print(f"[bench] {key} failed ({', '.join(f'{k}={record[k]}' for k in ('D', 'V', 'B') if k in record)}): "
                  f"{short_error(exc)}", file=sys.stderr, flush=True)
            if self.on_gpu:
                try:
                    torch.cuda.synchronize()
                except Exception:  # noqa: BLE001 - a broken context shows in the next contender's error
                    pass
            return None
        record[key] = us
        if isinstance(fn, Baseline):
            record.setdefault("compiled", {})[key] = fn.is_compiled
        return us

    def weights(self, shapes: str):
        """(D, V, LM-head weight [V, D]) of each ``DxV`` shape in turn (problems.lm_head_weight)."""
        for dim, vocab in shape_list(shapes):
            yield dim, vocab, lm_head_weight(vocab, dim, dtype=self.dtype, device=self.device)
            if self.on_gpu:
                torch.cuda.empty_cache()

    def all_records(self) -> list[dict]:
        """This run's records after the appended file's, less those of the shapes this run measures."""
        shapes = set(shape_list(self.args.shapes))
        earlier = [r for r in self.previous["records"] if (r["D"], r["V"]) not in shapes] if self.previous else []
        return earlier + self.results["records"]

    def results_to_write(self) -> dict:
        return {**self.results, "records": self.all_records()}

    def add(self, record: dict, table: Callable[[dict], str], baselines: Iterable[str] = ()) -> None:
        """Adds the ratios ``ours_over_plain`` and ``<baseline>_over_ours`` for each ``<baseline>_us``
        key to ``record``, appends it, prints it and rewrites the .json and .md (no plot) where
        results are written."""
        ours = record.get("ours_us")
        record["ours_over_plain"] = ratio(ours, record.get("plain_us"))
        for key in baselines:
            record[key.replace("_us", "_over_ours")] = ratio(record.get(key), ours)
        self.results["records"].append(record)
        print("[bench] " + json.dumps(record), flush=True)
        if self.out:
            write_results(self.out, self.stem, self.results_to_write(), table(self.results_to_write()))

    def finish(self, table: Callable[[dict], str], checks: Callable[[dict], list[str]],
               plot: Callable[[dict, Path], None] | None) -> None:
        """Writes the results with the plot (where results are written), then prints the target
        checks and the markdown table last."""
        results = self.results_to_write()
        text = finished_text(results, table, checks)
        if self.out:
            stem = write_results(self.out, self.stem, results, text, plot)
            print(f"[bench] wrote {stem}.*", file=sys.stderr)
        print(text)


def finished_text(results: dict, table: Callable[[dict], str], checks: Callable[[dict], list[str]]) -> str:
    """Sets ``results["checks"]`` and returns the text a run ends with: the check lines, then the table."""
    results["checks"] = checks(results)
    return "\n".join(["Target checks (from this run's ratios):", ""] + [f"- {c}" for c in results["checks"]]
                     + ["", table(results)])


def rewrite_results(path: Path) -> Path:
    """Rewrites the .md and .png beside the .json of a run of ``bench_<benchmark>.py`` (one of this
    module's benchmarks), as :meth:`Bench.finish` writes them."""
    results = json.loads(path.read_text())
    module = importlib.import_module(f"bench_{results['benchmark']}")
    text = finished_text(results, module.markdown_table, module.checks)
    return write_results(path.parent, path.stem, results, text, module.plot)


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def ratio_summary(label: str, ratios: list[float]) -> str:
    """The closing line of a same-run A/B probe: its ratios' count, median and range."""
    return (f"# {label} over {len(ratios)} cells: median {statistics.median(ratios):.3f}, "
            f"min {min(ratios):.3f}, max {max(ratios):.3f}")


def cell(value: float | None, spec: str = ".0f", suffix: str = "") -> str:
    return "—" if value is None else f"{value:{spec}}{suffix}"


def baseline_cells(record: dict, *names: str) -> list[str]:
    """The cells ``<name>_us`` and ``<name>_over_ours`` of each baseline."""
    return [c for name in names for c in (cell(record.get(f"{name}_us")),
                                          cell(record.get(f"{name}_over_ours"), ".2f", "×"))]


def shape_tables(results: dict, title: str, head: list[str], row: Callable[[dict], list[str]]) -> str:
    """One markdown table per (D, V) of the records: a line naming the shape, ``title``, the run and
    how it timed and compiled, then ``head`` and ``row(record)`` of each record."""
    lines = []
    records = results["records"]
    compiled = "compiled" if results["compile"]["enabled"] else "eager"
    for dim, vocab in dict.fromkeys((r["D"], r["V"]) for r in records):
        lines.append(f"\n**D={dim}, V={vocab}, {title}, T = {results['temperature']}** ({results['device']}, "
                     f"{results['date']}, {results['dtype']}, "
                     f"{'CUDA-graph replays' if results['timing'] == 'graph' else 'eager calls'}, median µs; ratios "
                     f"from the same run; torch baselines {compiled})\n")
        lines.append("| " + " | ".join(head) + " |")
        lines.append("|" + "---|" * len(head))
        lines += ["| " + " | ".join(row(r)) + " |" for r in records if (r["D"], r["V"]) == (dim, vocab)]
    return "\n".join(lines)


def check_line(label: str, cells: list[tuple[str, float]], ok: Callable[[float], bool], *, worst=max,
               note: str = "") -> str:
    """``PASS`` / ``FAIL`` of ``ok`` over the measured ``(where, value)`` cells, with the worst one."""
    if not cells:
        return f"{label}: not measured"
    failed = [c for c in cells if not ok(c[1])]
    where, value = worst(cells, key=lambda c: c[1])
    verdict = "PASS" if not failed else f"FAIL in {len(failed)} of"
    return (f"{label}: {verdict} {len(cells)} cells (worst {value:.3f} at {where})"
            + (f"; fails at {', '.join(f'{w} ({v:.3f})' for w, v in failed)}" if failed else "")
            + (f" {note}" if note else ""))


def faster_check(label: str, records: list[dict], keys: Iterable[str], where: Callable[[dict], str],
                 note: str = "") -> str:
    """:func:`check_line` of ours being faster than each baseline of ``keys`` (``<baseline>_over_ours``
    ratios): per record the smallest of them, over the records that have one."""
    cells = []
    for r in records:
        values = [r[k] for k in keys if r.get(k) is not None]
        if values:
            cells.append((where(r), min(values)))
    return check_line(label, cells, lambda v: v > 1.0, worst=min, note=note)


def eager_note(results: dict) -> str:
    """What the checks against compiled baselines must say where the baselines did not compile."""
    compile_info = results["compile"]
    if not compile_info["enabled"]:
        return f"(baselines eager: {compile_info['reason']})"
    if compile_info["failed"]:
        return f"(torch.compile failed for {', '.join(sorted(compile_info['failed']))}: eager there)"
    return ""


Line = tuple[str, Callable[[dict], bool], Callable[[dict], "float | None"], str]


def plot_lines(results: dict, path: Path, lines: list[Line], *,
               title: Callable[[tuple], str] = lambda k: f"D={k[0]}, V={k[1]}",
               ylabel: str = "time / our plain sampling") -> None:
    """One panel per shape (D, V), x = the batch size (log2), one line per
    ``(label, select(record), y(record), matplotlib format)``; a line with no points is left out."""
    panel = lambda r: (r["D"], r["V"])  # noqa: E731
    plt = pyplot_or_none("bench")
    if plt is None:
        return
    records = results["records"]
    panels = list(dict.fromkeys(panel(r) for r in records))
    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 4.8), squeeze=False)
    for ax, key in zip(axes[0], panels):
        rows = [r for r in records if panel(r) == key]
        for label, select, y, fmt in lines:
            pts = sorted((r["B"], y(r)) for r in rows if select(r) and y(r) is not None)
            if pts:
                ax.plot(*zip(*pts), fmt, label=label)
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("batch size B")
        ax.set_ylabel(ylabel)
        ax.set_title(title(key))
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=6)
    fig.suptitle(f"{results['device']} — {results['date']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def ratio_lines(labels: Iterable[str], select: Callable[[dict, str], bool], key: str, label: str,
                fmt: str) -> list[Line]:
    """:func:`plot_lines`' lines of ``record[key] / record["plain_us"]`` for each label (``label``
    formatted with ``{}`` = the label)."""
    return [(label.format(x), lambda r, x=x: select(r, x), lambda r: ratio(r.get(key), r.get("plain_us")), fmt)
            for x in labels]


def call_signature(fn: Callable) -> str:
    try:
        return f"{getattr(fn, '__name__', 'fn')}{inspect.signature(fn)}"
    except (TypeError, ValueError):
        return getattr(fn, "__name__", "fn")


if __name__ == "__main__":
    for name in sys.argv[1:]:
        print(f"rewrote {rewrite_results(Path(name))}.*")
